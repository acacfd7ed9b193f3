// Python bindings of recover_hsdp._C. The Python face (recover_hsdp/collectives) wraps these;
// nothing here is public API.
#include <torch/extension.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/headeronly/version.h>

#include "ProcessGroupULFM.hpp"
#include "UlfmComm.hpp"
#include "election.h"
#include "ulfm_mpi.h"

namespace py = pybind11;
using namespace recover_hsdp;

namespace {

#define RH_STR2(x) #x
#define RH_STR(x) RH_STR2(x)
constexpr const char* kBuiltTorchVersion =
    RH_STR(TORCH_VERSION_MAJOR) "." RH_STR(TORCH_VERSION_MINOR) "." RH_STR(TORCH_VERSION_PATCH);

// Raise the Python-side typed exception (recover_hsdp.collectives.errors) for a C++ error;
// a plain RuntimeError if that module cannot be imported.
void raisePython(const char* cls_name, const char* what, int error_class) {
  try {
    py::object mod = py::module_::import("recover_hsdp.collectives.errors");
    py::object cls = mod.attr(cls_name);
    py::object exc = error_class >= 0 ? cls(what, error_class) : cls(what);
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (py::error_already_set&) {
    PyErr_SetString(PyExc_RuntimeError, what);
  }
}

py::tuple censusTuple(const Census& c) {
  return py::make_tuple(c[0], c[1], c[2], c[3], c[4]);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "recover_hsdp C++ ULFM backend (internal; use recover_hsdp.collectives)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const UlfmUnavailable& e) {
      raisePython("UlfmUnavailableError", e.what(), -1);
    } catch (const UlfmError& e) {
      raisePython("UlfmError", e.what(), e.errorClass());
    }
  });

  m.attr("BUILT_TORCH_VERSION") = kBuiltTorchVersion;
  m.attr("HAVE_ULFM") = libraryHasUlfm();
  m.attr("ERR_PROC_FAILED") = static_cast<int>(MPIX_ERR_PROC_FAILED);
  m.attr("ERR_REVOKED") = static_cast<int>(MPIX_ERR_REVOKED);

  py::class_<FailureRecord>(m, "FailureRecord")
      .def_readonly("ok", &FailureRecord::ok)
      .def_readonly("quiesced", &FailureRecord::quiesced)
      .def_readonly("reduce_failed", &FailureRecord::reduce_failed)
      .def_readonly("failed_ranks", &FailureRecord::failed_ranks)
      .def_readonly("epoch", &FailureRecord::epoch)
      .def_property_readonly("census", [](const FailureRecord& r) { return censusTuple(r.census); })
      .def_readonly("contrib", &FailureRecord::contrib)
      .def_readonly("at_boundary", &FailureRecord::at_boundary)
      .def_readonly("roles", &FailureRecord::roles);

  m.def("elect",
        [](const std::vector<int32_t>& roles, const std::vector<bool>& alive,
           const std::vector<int64_t>& contributed) {
          ElectionResult e = elect(roles, alive, contributed);
          return py::make_tuple(e.roles, censusTuple(e.census), e.contrib, e.at_boundary);
        },
        py::arg("roles"), py::arg("alive"), py::arg("contributed"),
        "Pure spare election: -> (roles of the survivors, census, contrib, at_boundary).");

  m.def("ensure_mpi", &ensureMpi, py::call_guard<py::gil_scoped_release>());
  m.def("ft_enabled", &ftEnabled);
  m.def("cuda_aware_mpi", &cudaAwareMpi);
  m.def("world_rank", &worldRank);
  m.def("world_size", &worldSize);
  m.def("mpi_library_version", &mpiLibraryVersion);
  m.def("owns_mpi", &ownsMpi);
  m.def("failure_seen", &failureSeen);
  m.def("finalize_if_owner", &finalizeIfOwner, py::call_guard<py::gil_scoped_release>());

  py::class_<UlfmComm, std::shared_ptr<UlfmComm>>(m, "UlfmComm")
      .def_static("world", &UlfmComm::world, py::call_guard<py::gil_scoped_release>())
      .def_static("from_ranks", &UlfmComm::fromRanks, py::arg("world_ranks"),
                  py::call_guard<py::gil_scoped_release>())
      .def("subgroup", &UlfmComm::subgroup, py::arg("world_ranks"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &UlfmComm::rank)
      .def_property_readonly("size", &UlfmComm::size)
      .def_property_readonly("epoch", &UlfmComm::epoch)
      .def_property_readonly("world_ranks", &UlfmComm::worldRanks)
      .def_property_readonly("quiesced", &UlfmComm::quiesced)
      .def_property_readonly("contributed", &UlfmComm::contributed)
      .def("roles", &UlfmComm::roles)
      .def("allreduce", &UlfmComm::allreduce, py::arg("tensor"),
           py::call_guard<py::gil_scoped_release>())
      .def("consensus", &UlfmComm::consensus, py::call_guard<py::gil_scoped_release>())
      .def("barrier", &UlfmComm::barrier, py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &UlfmComm::broadcast, py::arg("tensor"), py::arg("root"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_roles", &UlfmComm::setRoles, py::arg("roles"))
      .def("set_contributed", &UlfmComm::setContributed, py::arg("n"))
      .def("set_quiesce", &UlfmComm::setQuiesce, py::arg("flag"))
      .def("last_record", &UlfmComm::lastRecord)
      .def("revoke", &UlfmComm::revoke, py::call_guard<py::gil_scoped_release>())
      .def("poll_failures", &UlfmComm::pollFailures, py::call_guard<py::gil_scoped_release>())
      .def("_debug_kill_at", &UlfmComm::debugKillAt, py::arg("point"), py::arg("delay_us") = 0)
      .def("_debug_split_data", &UlfmComm::debugSplitData, py::arg("parts"))
      .def("_debug_fail_next_data", &UlfmComm::debugFailNextData)
      .def("_debug_stage_cpu", &UlfmComm::debugStageCpu, py::arg("on"),
           py::arg("throw_at_chunk") = -1)
      .def_static("_stage_chunk_bytes", &UlfmComm::stageChunkBytesAgreed);

  py::class_<ProcessGroupULFM, c10d::Backend, c10::intrusive_ptr<ProcessGroupULFM>>(
      m, "ProcessGroupULFM")
      .def(py::init([](std::shared_ptr<UlfmComm> comm) {
             return c10::make_intrusive<ProcessGroupULFM>(std::move(comm));
           }),
           py::arg("comm"))
      .def_property_readonly("comm", &ProcessGroupULFM::comm)
      .def_property_readonly("epoch", &ProcessGroupULFM::epoch)
      .def_property_readonly("stale", &ProcessGroupULFM::stale)
      .def("last_record", &ProcessGroupULFM::lastRecord);

  py::class_<WorkULFM, c10d::Work, c10::intrusive_ptr<WorkULFM>>(m, "WorkULFM")
      .def("record", &WorkULFM::record);
}
