#include "ProcessGroupULFM.hpp"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

namespace recover_hsdp {

WorkULFM::WorkULFM(c10d::OpType op, std::vector<at::Tensor> outputs, FailureRecord record)
    : c10d::Work(-1, op),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))),
      record_(std::move(record)) {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

std::vector<at::Tensor> WorkULFM::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkULFM::getFuture() {
  return future_;
}

ProcessGroupULFM::ProcessGroupULFM(std::shared_ptr<UlfmComm> comm)
    : c10d::Backend(comm->rank(), comm->size()), comm_(std::move(comm)), epoch_(comm_->epoch()) {
  last_ = comm_->lastRecord();
}

bool ProcessGroupULFM::stale() const {
  return comm_->epoch() != epoch_;
}

void ProcessGroupULFM::checkCurrent(const char* op) const {
  TORCH_CHECK(
      !stale(),
      "ulfm backend: ", op, " on a stale process group (built for epoch ", epoch_,
      " with ", getSize(), " ranks; the group was repaired and is now at epoch ",
      comm_->epoch(), " with ", comm_->size(), " ranks): use UlfmGroup.pg for the current one");
}

FailureRecord ProcessGroupULFM::lastRecord() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::finish(
    c10d::OpType op,
    std::vector<at::Tensor> outputs,
    FailureRecord rec) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    last_ = rec;
  }
  return c10::make_intrusive<WorkULFM>(op, std::move(outputs), std::move(rec));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1,
              "ulfm backend does not support allreduce of ", tensors.size(),
              " tensors in one call (pass exactly one)");
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM,
              "ulfm backend does not support reduce op ", static_cast<int>(opts.reduceOp.op_), " (SUM only)");
  checkCurrent("allreduce");
  FailureRecord rec = comm_->allreduce(tensors[0]);
  return finish(c10d::OpType::ALLREDUCE, tensors, std::move(rec));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  TORCH_CHECK(tensors.size() == 1,
              "ulfm backend does not support broadcast of ", tensors.size(),
              " tensors in one call (pass exactly one)");
  TORCH_CHECK(opts.rootTensor == 0, "ulfm backend does not support rootTensor != 0");
  checkCurrent("broadcast");
  FailureRecord rec = comm_->broadcast(tensors[0], static_cast<int>(opts.rootRank));
  return finish(c10d::OpType::BROADCAST, tensors, std::move(rec));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::barrier(const c10d::BarrierOptions& /*opts*/) {
  checkCurrent("barrier");
  FailureRecord rec = comm_->barrier();
  return finish(c10d::OpType::BARRIER, {}, std::move(rec));
}

} // namespace recover_hsdp
