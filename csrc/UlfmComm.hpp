// UlfmComm: one fault-tolerant communicator and the ReCoVer collective protocol over it.
//
// Threading contract: every operation runs synchronously in the calling thread and holds the
// communicator's mutex for its whole duration, so operations on one UlfmComm are serialised
// (MPI requires collectives on a communicator to be issued in the same order everywhere; two
// threads racing on one communicator would break that anyway). Operations on different
// UlfmComms may run concurrently when MPI provides MPI_THREAD_MULTIPLE; below that level all
// MPI calls are serialised process-wide.
//
// Protocol of every fault-aware call (allreduce, consensus, barrier, broadcast):
//   Detect  MPIX_Comm_agree over the flag "my communicator is not revoked". The agreement is
//           uniform: every survivor gets the same outcome.
//   Repair  (agree raised a failure, or some member had revoked) MPIX_Comm_revoke,
//           MPIX_Comm_shrink, epoch += 1; the lost members' MPI_COMM_WORLD ranks are recorded.
//   Record  one MPI_Allgather of (role, contributed) over the repaired communicator, then the
//           pure election (election.h). Then back to Detect on the repaired communicator: a
//           member that died during Record is repaired away in the same call, until an agree
//           passes. Every survivor leaves with the identical record. A call that repaired
//           returns ok=false and moves no data.
//   Data    only when the first Detect passed: allreduce (spares contribute zeros) or bcast.
//           If the MPI data collective itself fails, this rank revokes the communicator and
//           returns ok=false, reduce_failed=true, failed_ranks=() with the epoch unchanged; NO
//           repair here (repairing inside a data phase can deadlock against collectives on
//           other groups). The revocation makes the next Detect on this group fail uniformly.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "ulfm_mpi.h"
#include "ulfm_types.h"

// Internal to the extension module (also keeps pybind11's hidden types consistent).
#pragma GCC visibility push(hidden)
namespace recover_hsdp {

class UlfmComm : public std::enable_shared_from_this<UlfmComm> {
 public:
  // Duplicate of MPI_COMM_WORLD (collective over every MPI rank).
  static std::shared_ptr<UlfmComm> world();
  // Communicator over the given MPI_COMM_WORLD ranks, group rank i = world_ranks[i]; collective
  // over those ranks only (MPI_Comm_create_group on MPI_COMM_WORLD). Throws UlfmUnavailable for
  // ranks that do not exist, std::invalid_argument for duplicates or when the caller is not a
  // member, UlfmError (MPI_ERR_PROC_FAILED) once any rank of the job has died: Open MPI refuses
  // to create communicators from a parent holding a failed process. After failures use
  // subgroup() of a repaired group, or repair groups in place.
  static std::shared_ptr<UlfmComm> fromRanks(const std::vector<int64_t>& world_ranks);
  // The same over this communicator (current members only): works after failures as long as
  // this group is repaired (its last call passed Detect). Collective over the new members only.
  // On a failure-class error this group is revoked (its next call repairs) and UlfmError raised.
  std::shared_ptr<UlfmComm> subgroup(const std::vector<int64_t>& world_ranks);

  ~UlfmComm();
  UlfmComm(const UlfmComm&) = delete;
  UlfmComm& operator=(const UlfmComm&) = delete;

  int rank() const;
  int size() const;
  int64_t epoch() const;
  std::vector<int64_t> worldRanks() const;

  FailureRecord allreduce(at::Tensor& tensor);
  FailureRecord consensus();
  FailureRecord barrier();
  FailureRecord broadcast(at::Tensor& tensor, int root);

  // The role of every member in group-rank order (size() entries, valid Role integers).
  void setRoles(const std::vector<int32_t>& roles);
  std::vector<int32_t> roles() const;
  void setContributed(int64_t n);
  int64_t contributed() const;
  void setQuiesce(bool flag);
  bool quiesced() const;
  FailureRecord lastRecord() const;

  // The control plane of an async data plane (recover_hsdp/hsdp/dataplane): local, no
  // collective. revoke(): MPIX_Comm_revoke (every member's next call repairs; its messages are
  // pushed for ~100 ms). pollFailures(): drives MPI progress once (an MPI_Iprobe on
  // MPI_COMM_SELF), then returns {revoked, MPI_COMM_WORLD ranks of the members this process
  // knows to have failed (MPIX_Comm_get_failed)}.
  void revoke();
  std::pair<bool, std::vector<int64_t>> pollFailures();

  // Test hooks (used by the multi-process failure tests only). This rank SIGKILLs itself at
  // `point` of its next fault-aware call: "detect" (before the agree), "record" (after a
  // repair, before the Record collective), "data" (after Detect passed, before the MPI data
  // collective), "data_async" (a timer thread fires delay_us after the data collective is
  // posted: a death somewhere around the transfer, by timing), "data_mid" (allreduce split
  // with debugSplitData(k > 1) on every member: this rank dies after the first MPI_Allreduce
  // part, before it posts the second: a death inside the transfer by construction; its peers
  // must see reduce_failed; not split: dies before the transfer). "" clears.
  void debugKillAt(const std::string& point, int64_t delay_us);
  // CPU allreduce only: send the transfer as `parts` MPI_Allreduce calls (every member must
  // set the same value; 1 = one call per INT_MAX elements, the default).
  void debugSplitData(int64_t parts);
  // The next data phase runs normally, then this rank reports it as failed (reduce_failed) and
  // revokes the communicator at the start of its next call: the asymmetric outcome "this rank
  // saw a failure in the reduction, its peers did not" (an immediate revoke could interrupt
  // peers still finishing the same collective; the test also holds the next call back until
  // the peers have left this one).
  void debugFailNextData();
  // Route CPU tensors through the staged loop (on) and throw inside it before reducing chunk
  // `throw_at_chunk` (-1: never): a CUDA error's path, on CPU (issue 24 item 8).
  void debugStageCpu(bool on, int64_t throw_at_chunk);
  // The chunk size (bytes) every member's data collectives use, agreed at world creation.
  static int64_t stageChunkBytesAgreed();

 private:
  UlfmComm(MPI_Comm comm, std::vector<int64_t> world_ranks);

  enum class KillPoint { NONE, DETECT, RECORD, DATA, DATA_ASYNC, DATA_MID };

  // Detect-Repair-Record; returns ok=true iff the first agree passed. Caller holds mu_.
  FailureRecord protocolLocked();
  void repairLocked(std::vector<int64_t>& failed);
  bool recordLocked(std::vector<int64_t>& gathered);
  FailureRecord okRecordLocked() const;
  // A failed data collective: revoke, ok=false, reduce_failed=true. Throws for non-failures.
  FailureRecord dataFailedLocked(int rc, const char* call);
  // The end of a data phase (after buf.finish() on success): the failure path, or the
  // debugFailNextData hook, or `rec` unchanged.
  FailureRecord dataDoneLocked(int rc, const char* call, FailureRecord rec);
  void maybeKill(KillPoint here);
  // CUDA tensor, MPI not CUDA-aware: the all-reduce through a pinned host buffer, chunked and
  // pipelined (device-to-host of every chunk queued on the current stream first; each chunk is
  // reduced as soon as its copy is done and its host-to-device copy queued behind). Returns the
  // MPI return code; on success the tensor holds the sum when this returns. Caller holds mu_.
  int stagedAllreduceLocked(at::Tensor& tensor, MPI_Datatype type, MPI_Op op);

  mutable std::mutex mu_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1;
  int size_ = 0;
  int64_t epoch_ = 0;
  std::vector<int64_t> world_ranks_;
  std::vector<int32_t> roles_;
  int64_t contributed_ = 0;
  std::atomic<bool> quiesce_{false};
  FailureRecord last_;

  KillPoint kill_point_ = KillPoint::NONE;
  int64_t kill_delay_us_ = 0;
  int64_t debug_split_ = 1;
  bool fail_next_data_ = false;
  bool revoke_at_next_call_ = false;
  bool stage_cpu_ = false;       // test hook: CPU tensors through the staged loop
  int64_t throw_at_chunk_ = -1;  // test hook: throw before reducing this chunk
  at::Tensor stage_;  // pinned host staging buffer (bytes): allocated once, grown as needed
};

} // namespace recover_hsdp
#pragma GCC visibility pop
