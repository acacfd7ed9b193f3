// ProcessGroupULFM: the torch.distributed (c10d) face of one UlfmComm, registered as backend
// "ulfm". A c10d::Backend has a constant rank and size, so a repair (which shrinks the
// communicator) makes this object stale: every later op on it raises, and the Python
// UlfmGroup builds a new ProcessGroupULFM (and a new torch ProcessGroup) over the same UlfmComm.
//
// Threading contract: ops run synchronously in the calling thread (see UlfmComm.hpp) and
// return an already-completed WorkULFM whose future is set; the failure record of the call is
// on the Work and also in lastRecord() (downcasting a Work through Python is fragile).
// Failures of peers are recorded, never raised: a Work is always successful.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "UlfmComm.hpp"

// Internal to the extension module (also keeps pybind11's hidden types consistent).
#pragma GCC visibility push(hidden)
namespace recover_hsdp {

class WorkULFM : public c10d::Work {
 public:
  WorkULFM(c10d::OpType op, std::vector<at::Tensor> outputs, FailureRecord record);

  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  const FailureRecord& record() const {
    return record_;
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  FailureRecord record_;
};

class ProcessGroupULFM : public c10d::Backend {
 public:
  explicit ProcessGroupULFM(std::shared_ptr<UlfmComm> comm);

  const std::string getBackendName() const override {
    return "ulfm";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  FailureRecord lastRecord() const;
  std::shared_ptr<UlfmComm> comm() const {
    return comm_;
  }
  int64_t epoch() const {
    return epoch_;
  }
  bool stale() const;

 private:
  void checkCurrent(const char* op) const;
  c10::intrusive_ptr<c10d::Work> finish(
      c10d::OpType op,
      std::vector<at::Tensor> outputs,
      FailureRecord rec);

  std::shared_ptr<UlfmComm> comm_;
  const int64_t epoch_;  // the communicator epoch this rank/size are valid for
  mutable std::mutex mu_;
  FailureRecord last_;
};

} // namespace recover_hsdp
#pragma GCC visibility pop
