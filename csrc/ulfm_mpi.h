// MPI plumbing for the ULFM backend: initialisation, the ULFM availability checks, one error
// path (MPI_CHECK -> UlfmError with file, line and MPI error class) and dtype/op mapping.
#pragma once

#include <mpi.h>
#include <mpi-ext.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include <c10/core/ScalarType.h>

#if defined(MPIX_ERR_PROC_FAILED) && defined(MPIX_ERR_REVOKED)
#define RECOVER_HSDP_HAVE_ULFM 1
#else
#define RECOVER_HSDP_HAVE_ULFM 0
// An MPI without the ULFM API: ensureMpi() refuses to run, these stubs only keep it compiling.
#define MPIX_ERR_PROC_FAILED (-1001)
#define MPIX_ERR_REVOKED (-1002)
inline int MPIX_Comm_agree(MPI_Comm, int*) { return MPI_ERR_UNSUPPORTED_OPERATION; }
inline int MPIX_Comm_revoke(MPI_Comm) { return MPI_ERR_UNSUPPORTED_OPERATION; }
inline int MPIX_Comm_is_revoked(MPI_Comm, int*) { return MPI_ERR_UNSUPPORTED_OPERATION; }
inline int MPIX_Comm_shrink(MPI_Comm, MPI_Comm*) { return MPI_ERR_UNSUPPORTED_OPERATION; }
#endif

// Internal to the extension module (also keeps pybind11's hidden types consistent).
#pragma GCC visibility push(hidden)
namespace recover_hsdp {

// A non-failure MPI error (or a failure where none can be tolerated). error_class is the MPI
// error class (MPI_Error_class of the return code).
class UlfmError : public std::runtime_error {
 public:
  UlfmError(const std::string& what, int error_class)
      : std::runtime_error(what), error_class_(error_class) {}
  int errorClass() const {
    return error_class_;
  }

 private:
  int error_class_;
};

// ULFM cannot be used here at all: library without ULFM, job launched without
// `--with-ft ulfm`, MPI already finalised, nonexistent ranks. The message is one line.
class UlfmUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

int mpiErrorClass(int code);
std::string mpiErrorString(int code);

// True for the classes that mean "a peer failed or the communicator was revoked": these are
// handled by the protocol (Detect/Repair/Record), never thrown.
bool isFailureClass(int error_class);

[[noreturn]] void throwMpiError(int code, const char* call, const char* file, int line);

#define MPI_CHECK(cmd)                                                   \
  do {                                                                   \
    int mpi_rc_ = (cmd);                                                 \
    if (mpi_rc_ != MPI_SUCCESS) {                                        \
      ::recover_hsdp::throwMpiError(mpi_rc_, #cmd, __FILE__, __LINE__);  \
    }                                                                    \
  } while (0)

// Initialise MPI (THREAD_MULTIPLE) unless someone (mpi4py) already did, then check that this
// library has ULFM and that the job runs with fault tolerance enabled. Throws UlfmUnavailable.
// Idempotent and thread-safe.
void ensureMpi();

// Whether ops must be serialised process-wide (the MPI thread level is below MULTIPLE).
bool needGlobalMpiLock();

// Whether this extension called MPI_Init_thread (and so should finalise at exit).
bool ownsMpi();
// MPI_Finalize if we own MPI, it is not finalised yet and this process never saw a failure:
// MPI_Finalize can hang after failures (open-mpi/ompi#11404), so a process that saw one exits
// without it (under --with-ft ulfm the launcher accepts that).
void finalizeIfOwner();
// Called by the protocol whenever it repairs or sees a failed data phase.
void noteFailureSeen();
bool failureSeen();

// Diagnostics for the Python face.
bool libraryHasUlfm();   // compiled against a library with the MPIX_ fault-tolerance API
int ftEnabled();         // 1/0 from the `mpi_ft_enable` MCA parameter, -1 if unknown
bool cudaAwareMpi();     // MPIX_Query_cuda_support() where the library has it
int worldRank();
int worldSize();
std::string mpiLibraryVersion();

// MPI datatype and SUM op for a tensor dtype. float16/bfloat16 use commutative user ops.
// Throws std::invalid_argument naming the dtype when unsupported.
struct MpiTypeOp {
  MPI_Datatype type;
  MPI_Op op;
};
MpiTypeOp mpiSumFor(c10::ScalarType dtype);
MPI_Datatype mpiTypeFor(c10::ScalarType dtype);  // for data motion without reduction

} // namespace recover_hsdp
#pragma GCC visibility pop
