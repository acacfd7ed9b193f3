#include "UlfmComm.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "election.h"

namespace recover_hsdp {

namespace {

constexpr int kCreateGroupTag = 0x5ec0;  // MPI_Comm_create_group tag of from_ranks()
constexpr int64_t kMaxCount = INT_MAX;  // MPI counts are int: larger buffers go in chunks

std::mutex g_mpi_mutex;  // used only when MPI is below THREAD_MULTIPLE

// Serialises MPI process-wide when the thread level is below MULTIPLE; a no-op otherwise.
std::unique_lock<std::mutex> lockGlobal() {
  if (needGlobalMpiLock()) {
    return std::unique_lock<std::mutex>(g_mpi_mutex);
  }
  return std::unique_lock<std::mutex>();
}

// Bytes per staged chunk (RECOVER_HSDP_STAGE_CHUNK_MB, default 16 MiB): small enough that the
// copies of neighbouring chunks overlap the reduction of this one, large enough for full PCIe /
// NVLink-C2C bandwidth and a cheap MPI call.
int64_t stageChunkBytes() {
  static const int64_t bytes = [] {
    const char* env = std::getenv("RECOVER_HSDP_STAGE_CHUNK_MB");
    double mb = env != nullptr ? std::atof(env) : 16.0;
    if (!(mb > 0)) {
      mb = 16.0;
    }
    return std::max<int64_t>(4096, static_cast<int64_t>(mb * 1024 * 1024));
  }();
  return bytes;
}

// The chunk size every member uses, agreed (MPI_MIN over MPI_COMM_WORLD) when the world group is
// made (issue 24 item 8): a per-process RECOVER_HSDP_STAGE_CHUNK_MB can no longer make two ranks
// post different MPI_Allreduce sequences. Every communicator is a subgroup of that world.
std::atomic<int64_t> g_agreed_chunk_bytes{0};

int64_t agreedChunkBytes() {
  const int64_t v = g_agreed_chunk_bytes.load();
  return v > 0 ? v : stageChunkBytes();
}

// Elements per MPI call of a data collective, the same on EVERY path (staged through host or
// direct, CPU or CUDA tensor), so members that differ in device post the same sequence.
int64_t chunkElems(int64_t esize) {
  return std::max<int64_t>(1, std::min<int64_t>(agreedChunkBytes() / esize, kMaxCount));
}

// Drive MPI progress for a bounded ~100 ms after a revoke: the revoke's messages leave only
// while this process progresses MPI (ob1/tcp has no progress thread), and a rank that throws
// may not call MPI again before its fail-stop; its peers must learn of the revoke NOW.
void pushRevoke() {
  int flag = 0;
  for (int i = 0; i < 100; ++i) {
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_SELF, &flag, MPI_STATUS_IGNORE);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// RAII: on any exit of a staged all-reduce that did not finish (a CUDA error, a failed MPI
// call, the test hook), wait for the queued copies (errors swallowed) and revoke the
// communicator, so the peers leave their MPI_Allreduce now and the next Detect repairs.
struct StagedGuard {
  MPI_Comm comm;
  const c10::impl::DeviceGuardImplInterface* impl;  // null: a CPU tensor (test hook)
  c10::Device dev;
  bool finished = false;
  ~StagedGuard() {
    if (finished) {
      return;
    }
    try {
      if (impl != nullptr) {
        impl->synchronizeStream(impl->getStream(dev));
      }
    } catch (...) {
    }
    MPIX_Comm_revoke(comm);
    pushRevoke();
  }
};

[[noreturn]] void dieNow() {
  ::kill(::getpid(), SIGKILL);
  for (;;) {
    ::pause();
  }
}

// The tensor as a contiguous buffer MPI may read and write: the tensor itself when it is a
// contiguous CPU tensor (or a contiguous CUDA tensor under CUDA-aware MPI), otherwise a
// contiguous host/device copy written back by finish().
class DataBuffer {
 public:
  explicit DataBuffer(at::Tensor& tensor) : tensor_(tensor) {
    const auto dev = tensor.device();
    if (dev.is_cpu()) {
      buf_ = tensor.is_contiguous() ? tensor : tensor.contiguous();
    } else if (dev.is_cuda()) {
      if (cudaAwareMpi()) {
        buf_ = tensor.is_contiguous() ? tensor : tensor.contiguous();
        // MPI reads device memory outside the stream order: drain the current stream first.
        const auto* impl = c10::impl::getDeviceGuardImpl(dev.type());
        impl->synchronizeStream(impl->getStream(dev));
      } else {
        // Device-to-host copy on the current stream, synchronous with it.
        buf_ = tensor.cpu().contiguous();
      }
    } else {
      throw std::invalid_argument(
          "ulfm backend does not support tensors on device " + dev.str());
    }
    copy_back_ = !buf_.is_same(tensor);
  }

  void* data() {
    return buf_.data_ptr();
  }
  int64_t numel() const {
    return buf_.numel();
  }
  int64_t elementSize() const {
    return static_cast<int64_t>(buf_.element_size());
  }

  void finish() {
    if (copy_back_) {
      tensor_.copy_(buf_);
    }
  }

 private:
  at::Tensor& tensor_;
  at::Tensor buf_;
  bool copy_back_ = false;
};

// MPI_Comm_create_group over `parent` for the members with these MPI_COMM_WORLD ranks (group
// rank i = world_ranks[i]); collective over the members only. Open MPI refuses it
// (MPI_ERR_PROC_FAILED) when `parent` holds a failed process, even one outside the group: on
// MPI_COMM_WORLD that means once any rank of the job has died. Build subgroups of a repaired
// group instead (UlfmComm::subgroup), or repair in place. On a failure-class error the parent is
// revoked, so members still inside the call are released and the parent's next Detect repairs.
MPI_Comm createGroupComm(MPI_Comm parent, const std::vector<int64_t>& world_ranks) {
  std::vector<int> ranks_int(world_ranks.begin(), world_ranks.end());
  MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  MPI_CHECK(MPI_Group_incl(world_group, static_cast<int>(ranks_int.size()), ranks_int.data(),
                           &group));
  MPI_Comm comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(parent, group, kCreateGroupTag, &comm);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  if (rc != MPI_SUCCESS) {
    if (isFailureClass(mpiErrorClass(rc)) && parent != MPI_COMM_WORLD) {
      MPIX_Comm_revoke(parent);
    }
    throwMpiError(rc, "MPI_Comm_create_group", __FILE__, __LINE__);
  }
  return comm;
}

void checkDense(const at::Tensor& t, const char* op) {
  if (!t.defined()) {
    throw std::invalid_argument(std::string("ulfm ") + op + ": undefined tensor");
  }
  if (t.layout() != at::kStrided) {
    throw std::invalid_argument(std::string("ulfm backend does not support ") + op +
                                " of sparse or non-strided tensors");
  }
}

} // namespace

UlfmComm::UlfmComm(MPI_Comm comm, std::vector<int64_t> world_ranks)
    : comm_(comm), world_ranks_(std::move(world_ranks)) {
  MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
  roles_.assign(size_, static_cast<int32_t>(Role::MAJOR));
  last_ = okRecordLocked();
}

UlfmComm::~UlfmComm() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) {
    auto g = lockGlobal();  // MPI below THREAD_MULTIPLE: one thread in MPI at a time
    MPI_Comm_free(&comm_);  // local in Open MPI, also on a revoked communicator
  }
}

std::shared_ptr<UlfmComm> UlfmComm::world() {
  ensureMpi();
  auto g = lockGlobal();
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
  int n = 0;
  MPI_CHECK(MPI_Comm_size(dup, &n));
  std::vector<int64_t> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  if (g_agreed_chunk_bytes.load() == 0) {  // the chunking, agreed once by every member
    int64_t chunk = stageChunkBytes();
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &chunk, 1, MPI_INT64_T, MPI_MIN, dup));
    g_agreed_chunk_bytes.store(chunk);
  }
  return std::shared_ptr<UlfmComm>(new UlfmComm(dup, std::move(ranks)));
}

namespace {

// Rank-list checks shared by fromRanks and subgroup: ranks exist, are unique, include the caller
// and (for a subgroup) belong to the parent.
void validateRanks(const std::vector<int64_t>& world_ranks, const std::vector<int64_t>* parent) {
  int wsize = 0, wrank = 0;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &wsize));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &wrank));
  if (world_ranks.empty()) {
    throw std::invalid_argument("ulfm group: empty rank list");
  }
  std::vector<int64_t> missing, outside;
  std::unordered_set<int64_t> seen;
  std::unordered_set<int64_t> in_parent;
  if (parent) {
    in_parent.insert(parent->begin(), parent->end());
  }
  bool member = false;
  for (int64_t r : world_ranks) {
    if (r < 0 || r >= wsize) {
      missing.push_back(r);
    } else if (parent && !in_parent.count(r)) {
      outside.push_back(r);
    }
    if (!seen.insert(r).second) {
      throw std::invalid_argument("ulfm group: rank " + std::to_string(r) +
                                  " appears more than once in the rank list");
    }
    member = member || r == wrank;
  }
  auto join = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t r : v) {
      s += (s.empty() ? "" : ", ") + std::to_string(r);
    }
    return s;
  };
  if (!missing.empty()) {
    throw UlfmUnavailable("ulfm group: rank(s) " + join(missing) +
                          " do not exist (MPI world size is " + std::to_string(wsize) + ")");
  }
  if (!outside.empty()) {
    throw std::invalid_argument("ulfm subgroup: rank(s) " + join(outside) +
                                " are not members of the parent group (members: " +
                                join(*parent) + ")");
  }
  if (!member) {
    throw std::invalid_argument("ulfm group: the calling rank " + std::to_string(wrank) +
                                " is not in the rank list (group creation is collective over "
                                "the members only)");
  }
}

} // namespace

std::shared_ptr<UlfmComm> UlfmComm::fromRanks(const std::vector<int64_t>& world_ranks) {
  ensureMpi();
  validateRanks(world_ranks, nullptr);
  auto g = lockGlobal();
  MPI_Comm comm = createGroupComm(MPI_COMM_WORLD, world_ranks);
  return std::shared_ptr<UlfmComm>(new UlfmComm(comm, world_ranks));
}

std::shared_ptr<UlfmComm> UlfmComm::subgroup(const std::vector<int64_t>& world_ranks) {
  std::lock_guard<std::mutex> lk(mu_);
  validateRanks(world_ranks, &world_ranks_);
  auto g = lockGlobal();
  MPI_Comm comm = createGroupComm(comm_, world_ranks);
  return std::shared_ptr<UlfmComm>(new UlfmComm(comm, world_ranks));
}

int UlfmComm::rank() const {
  std::lock_guard<std::mutex> lk(mu_);
  return rank_;
}

int UlfmComm::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return size_;
}

int64_t UlfmComm::epoch() const {
  std::lock_guard<std::mutex> lk(mu_);
  return epoch_;
}

std::vector<int64_t> UlfmComm::worldRanks() const {
  std::lock_guard<std::mutex> lk(mu_);
  return world_ranks_;
}

void UlfmComm::setRoles(const std::vector<int32_t>& roles) {
  std::lock_guard<std::mutex> lk(mu_);
  if (static_cast<int>(roles.size()) != size_) {
    throw std::invalid_argument("set_roles: expected " + std::to_string(size_) +
                                " roles (one per member), got " +
                                std::to_string(roles.size()));
  }
  for (int32_t r : roles) {
    if (!isValidRole(r)) {
      throw std::invalid_argument("set_roles: invalid role " + std::to_string(r) +
                                  " (valid: 0..4, see recover_hsdp.types.Role)");
    }
  }
  roles_ = roles;
}

std::vector<int32_t> UlfmComm::roles() const {
  std::lock_guard<std::mutex> lk(mu_);
  return roles_;
}

void UlfmComm::setContributed(int64_t n) {
  if (n < 0) {
    throw std::invalid_argument("set_contributed: negative count " + std::to_string(n));
  }
  std::lock_guard<std::mutex> lk(mu_);
  contributed_ = n;
}

int64_t UlfmComm::contributed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return contributed_;
}

void UlfmComm::setQuiesce(bool flag) {
  quiesce_.store(flag);
}

bool UlfmComm::quiesced() const {
  return quiesce_.load();
}

void UlfmComm::revoke() {
  std::lock_guard<std::mutex> lk(mu_);
  auto g = lockGlobal();
  noteFailureSeen();
  MPIX_Comm_revoke(comm_);
  pushRevoke();
}

std::pair<bool, std::vector<int64_t>> UlfmComm::pollFailures() {
  std::lock_guard<std::mutex> lk(mu_);
  auto g = lockGlobal();
  int flag = 0;
  MPI_Status st;
  // progress: failure notifications and revoke messages are handled inside the progress engine
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_SELF, &flag, &st);
  int revoked = 0;
  MPIX_Comm_is_revoked(comm_, &revoked);
  std::vector<int64_t> failed;
  MPI_Group fg = MPI_GROUP_NULL;
  if (MPIX_Comm_get_failed(comm_, &fg) == MPI_SUCCESS && fg != MPI_GROUP_NULL) {
    int n = 0;
    MPI_Group_size(fg, &n);
    if (n > 0) {
      MPI_Group world_group = MPI_GROUP_NULL;
      MPI_Comm_group(MPI_COMM_WORLD, &world_group);
      std::vector<int> idx(n), in_world(n);
      std::iota(idx.begin(), idx.end(), 0);
      MPI_Group_translate_ranks(fg, n, idx.data(), world_group, in_world.data());
      MPI_Group_free(&world_group);
      for (int r : in_world) {
        if (r != MPI_UNDEFINED) {
          failed.push_back(r);
        }
      }
    }
    MPI_Group_free(&fg);
  }
  return {revoked != 0, failed};
}

FailureRecord UlfmComm::lastRecord() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_;
}

void UlfmComm::debugKillAt(const std::string& point, int64_t delay_us) {
  std::lock_guard<std::mutex> lk(mu_);
  if (point.empty()) {
    kill_point_ = KillPoint::NONE;
  } else if (point == "detect") {
    kill_point_ = KillPoint::DETECT;
  } else if (point == "record") {
    kill_point_ = KillPoint::RECORD;
  } else if (point == "data") {
    kill_point_ = KillPoint::DATA;
  } else if (point == "data_async") {
    kill_point_ = KillPoint::DATA_ASYNC;
  } else if (point == "data_mid") {
    kill_point_ = KillPoint::DATA_MID;
  } else {
    throw std::invalid_argument("debug kill point must be one of detect, record, data, "
                                "data_async, data_mid or empty; got '" + point + "'");
  }
  kill_delay_us_ = delay_us;
}

void UlfmComm::debugSplitData(int64_t parts) {
  std::lock_guard<std::mutex> lk(mu_);
  if (parts < 1) {
    throw std::invalid_argument("debug split must be >= 1");
  }
  debug_split_ = parts;
}

void UlfmComm::debugFailNextData() {
  std::lock_guard<std::mutex> lk(mu_);
  fail_next_data_ = true;
}

void UlfmComm::debugStageCpu(bool on, int64_t throw_at_chunk) {
  std::lock_guard<std::mutex> lk(mu_);
  stage_cpu_ = on;
  throw_at_chunk_ = throw_at_chunk;
}

int64_t UlfmComm::stageChunkBytesAgreed() {
  return agreedChunkBytes();
}

void UlfmComm::maybeKill(KillPoint here) {
  if (kill_point_ != here) {
    return;
  }
  kill_point_ = KillPoint::NONE;
  if (here == KillPoint::DATA_ASYNC) {
    const int64_t us = kill_delay_us_;
    std::thread([us] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      dieNow();
    }).detach();
    return;
  }
  dieNow();
}

FailureRecord UlfmComm::okRecordLocked() const {
  FailureRecord rec;
  rec.ok = true;
  rec.epoch = epoch_;
  rec.roles = roles_;
  rec.census = censusOf(roles_);
  return rec;
}

void UlfmComm::repairLocked(std::vector<int64_t>& failed) {
  noteFailureSeen();
  int rc = MPIX_Comm_revoke(comm_);
  if (rc != MPI_SUCCESS && !isFailureClass(mpiErrorClass(rc))) {
    throwMpiError(rc, "MPIX_Comm_revoke", __FILE__, __LINE__);
  }
  MPI_Comm shrunk = MPI_COMM_NULL;
  for (int attempt = 0;; ++attempt) {
    rc = MPIX_Comm_shrink(comm_, &shrunk);
    if (rc == MPI_SUCCESS) {
      break;
    }
    if (!isFailureClass(mpiErrorClass(rc)) || attempt >= 16) {
      throwMpiError(rc, "MPIX_Comm_shrink", __FILE__, __LINE__);
    }
  }
  MPI_CHECK(MPI_Comm_set_errhandler(shrunk, MPI_ERRORS_RETURN));

  // Survivors' MPI_COMM_WORLD ranks (shrink keeps their relative order); the lost members are
  // old group minus new group.
  int n = 0;
  MPI_CHECK(MPI_Comm_size(shrunk, &n));
  MPI_Group new_group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  MPI_CHECK(MPI_Comm_group(shrunk, &new_group));
  MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> idx(n), in_world(n);
  std::iota(idx.begin(), idx.end(), 0);
  MPI_CHECK(MPI_Group_translate_ranks(new_group, n, idx.data(), world_group, in_world.data()));
  MPI_Group_free(&new_group);
  MPI_Group_free(&world_group);

  std::unordered_map<int64_t, int32_t> role_of;
  for (size_t i = 0; i < world_ranks_.size(); ++i) {
    role_of[world_ranks_[i]] = roles_[i];
  }
  std::vector<int64_t> new_ranks(in_world.begin(), in_world.end());
  std::vector<int32_t> new_roles;
  std::unordered_set<int64_t> alive(new_ranks.begin(), new_ranks.end());
  for (int64_t r : new_ranks) {
    new_roles.push_back(role_of.at(r));
  }
  for (int64_t r : world_ranks_) {
    if (!alive.count(r)) {
      failed.push_back(r);
    }
  }

  MPI_Comm_free(&comm_);
  comm_ = shrunk;
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  size_ = n;
  world_ranks_ = std::move(new_ranks);
  roles_ = std::move(new_roles);
  epoch_ += 1;
}

bool UlfmComm::recordLocked(std::vector<int64_t>& gathered) {
  int64_t mine[2] = {roles_[rank_], contributed_};
  gathered.assign(2 * static_cast<size_t>(size_), 0);
  const int rc = MPI_Allgather(mine, 2, MPI_INT64_T, gathered.data(), 2, MPI_INT64_T, comm_);
  if (rc == MPI_SUCCESS) {
    return true;
  }
  if (!isFailureClass(mpiErrorClass(rc))) {
    throwMpiError(rc, "MPI_Allgather", __FILE__, __LINE__);
  }
  // Peers still inside the Allgather must not wait for this rank: revoke interrupts them.
  MPIX_Comm_revoke(comm_);
  return false;
}

FailureRecord UlfmComm::protocolLocked() {
  const std::vector<int32_t> roles0 = roles_;
  const std::vector<int64_t> ranks0 = world_ranks_;
  std::vector<int64_t> failed;
  std::vector<int64_t> gathered;
  bool repaired = false;
  bool record_ok = true;
  if (revoke_at_next_call_) {
    revoke_at_next_call_ = false;
    MPIX_Comm_revoke(comm_);
  }
  for (;;) {
    maybeKill(KillPoint::DETECT);
    int revoked = 0;
    int rc = MPIX_Comm_is_revoked(comm_, &revoked);
    if (rc != MPI_SUCCESS) {
      throwMpiError(rc, "MPIX_Comm_is_revoked", __FILE__, __LINE__);
    }
    int flag = (!revoked && record_ok) ? 1 : 0;
    rc = MPIX_Comm_agree(comm_, &flag);
    if (rc == MPI_SUCCESS && flag == 1) {
      break;
    }
    if (rc != MPI_SUCCESS && !isFailureClass(mpiErrorClass(rc))) {
      throwMpiError(rc, "MPIX_Comm_agree", __FILE__, __LINE__);
    }
    repairLocked(failed);
    repaired = true;
    maybeKill(KillPoint::RECORD);
    record_ok = recordLocked(gathered);
  }
  if (!repaired) {
    return okRecordLocked();
  }

  // The election runs over the membership at the start of the call: several repairs in one
  // call read as one failure of everyone lost. Survivors' roles and counts come from the last
  // Record (identical everywhere, the agree after it passed); the dead's roles from roles0.
  const size_t n0 = ranks0.size();
  std::unordered_map<int64_t, size_t> index0;
  for (size_t i = 0; i < n0; ++i) {
    index0[ranks0[i]] = i;
  }
  std::vector<int32_t> roles_in(roles0);
  std::vector<bool> alive(n0, false);
  std::vector<int64_t> contributed(n0, 0);
  for (int j = 0; j < size_; ++j) {
    const size_t i = index0.at(world_ranks_[j]);
    alive[i] = true;
    roles_in[i] = static_cast<int32_t>(gathered[2 * j]);
    contributed[i] = gathered[2 * j + 1];
  }
  ElectionResult e = elect(roles_in, alive, contributed);
  roles_ = e.roles;

  std::sort(failed.begin(), failed.end());
  FailureRecord rec;
  rec.ok = false;
  rec.failed_ranks = std::move(failed);
  rec.epoch = epoch_;
  rec.census = e.census;
  rec.contrib = e.contrib;
  rec.at_boundary = e.at_boundary;
  rec.roles = std::move(e.roles);
  return rec;
}

FailureRecord UlfmComm::dataDoneLocked(int rc, const char* call, FailureRecord rec) {
  if (rc != MPI_SUCCESS) {
    return dataFailedLocked(rc, call);
  }
  if (fail_next_data_) {  // test hook: report this completed data phase as failed
    fail_next_data_ = false;
    revoke_at_next_call_ = true;
    rec.ok = false;
    rec.reduce_failed = true;
  }
  return rec;
}

FailureRecord UlfmComm::dataFailedLocked(int rc, const char* call) {
  if (!isFailureClass(mpiErrorClass(rc))) {
    MPIX_Comm_revoke(comm_);  // peers inside the collective must not wait for this rank
    pushRevoke();
    throwMpiError(rc, call, __FILE__, __LINE__);
  }
  // Peers may still be inside the data collective waiting for this rank: revoke interrupts
  // them, and makes the next Detect on this communicator fail at every member.
  noteFailureSeen();
  MPIX_Comm_revoke(comm_);
  FailureRecord rec = okRecordLocked();
  rec.ok = false;
  rec.reduce_failed = true;
  return rec;
}

FailureRecord UlfmComm::allreduce(at::Tensor& tensor) {
  checkDense(tensor, "allreduce");
  const MpiTypeOp typeop = mpiSumFor(tensor.scalar_type());
  std::lock_guard<std::mutex> lk(mu_);
  auto g = lockGlobal();
  if (quiesce_.load()) {
    FailureRecord rec = okRecordLocked();
    rec.quiesced = true;
    last_ = rec;
    return rec;
  }
  FailureRecord rec = protocolLocked();
  if (!rec.ok) {
    last_ = rec;
    return rec;
  }
  if (isSpare(roles_[rank_])) {
    tensor.zero_();
  }
  if (size_ == 1) {
    // One member: the sum is the tensor itself. Nothing is copied or sent (Detect above still
    // ran, so a failure is still seen here); the test hooks still fire at the data point.
    maybeKill(KillPoint::DATA);
    maybeKill(KillPoint::DATA_ASYNC);
    maybeKill(KillPoint::DATA_MID);
    last_ = dataDoneLocked(MPI_SUCCESS, "MPI_Allreduce", rec);
    return last_;
  }
  if ((tensor.device().is_cuda() && !cudaAwareMpi()) || (stage_cpu_ && tensor.is_cpu())) {
    maybeKill(KillPoint::DATA);
    maybeKill(KillPoint::DATA_ASYNC);
    maybeKill(KillPoint::DATA_MID);
    const int rc = stagedAllreduceLocked(tensor, typeop.type, typeop.op);
    last_ = dataDoneLocked(rc, "MPI_Allreduce", rec);
    return last_;
  }
  DataBuffer buf(tensor);
  maybeKill(KillPoint::DATA);
  maybeKill(KillPoint::DATA_ASYNC);
  // test hooks: debugSplitData(k) on every member sends the transfer as k MPI_Allreduce calls
  // (the same on every rank); data_mid dies after the first, before posting the second, so the
  // death lands inside the transfer by construction: its peers are in the second call
  const int64_t chunk = debug_split_ > 1 && buf.numel() >= debug_split_
      ? (buf.numel() + debug_split_ - 1) / debug_split_
      : chunkElems(buf.elementSize());  // the agreed chunking (the staged loop's chunks too)
  if (kill_point_ == KillPoint::DATA_MID && chunk >= buf.numel()) {
    maybeKill(KillPoint::DATA_MID);  // not split: nothing to die inside, dies before it
  }
  char* ptr = static_cast<char*>(buf.data());
  int rc = MPI_SUCCESS;
  for (int64_t off = 0; off < buf.numel() && rc == MPI_SUCCESS; off += chunk) {
    if (off > 0) {
      maybeKill(KillPoint::DATA_MID);
    }
    const int n = static_cast<int>(std::min<int64_t>(chunk, buf.numel() - off));
    rc = MPI_Allreduce(MPI_IN_PLACE, ptr + off * buf.elementSize(), n, typeop.type, typeop.op,
                       comm_);
  }
  if (rc == MPI_SUCCESS) {
    buf.finish();
  }
  last_ = dataDoneLocked(rc, "MPI_Allreduce", rec);
  return last_;
}

int UlfmComm::stagedAllreduceLocked(at::Tensor& tensor, MPI_Datatype type, MPI_Op op) {
  // Only device-generic c10 APIs (Event, DeviceGuardImplInterface): this compiles against a
  // CPU-only torch and runs for CUDA tensors (and, through the test hook, for CPU tensors:
  // synchronous copies, no events).
  const c10::Device dev = tensor.device();
  const bool on_device = !tensor.is_cpu();
  at::Tensor src = tensor.is_contiguous() ? tensor : tensor.contiguous();
  at::Tensor flat = src.view({-1});
  const int64_t numel = flat.numel();
  const int64_t esize = static_cast<int64_t>(flat.element_size());
  if (numel == 0) {
    return MPI_SUCCESS;
  }
  const int64_t nbytes = numel * esize;
  if (!stage_.defined() || stage_.numel() < nbytes) {
    stage_ = at::Tensor();  // free the old buffer first: peak = the new one only
    stage_ = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(on_device));
  }
  at::Tensor host = stage_.narrow(0, 0, nbytes).view(flat.scalar_type());
  const int64_t chunk = chunkElems(esize);  // agreed by every member (world creation)
  const int64_t n_chunks = (numel + chunk - 1) / chunk;
  const auto* impl = on_device ? c10::impl::getDeviceGuardImpl(dev.type()) : nullptr;
  StagedGuard guard{comm_, impl, dev};  // any early exit: sync what is queued, revoke
  // 1. every device-to-host copy, in order, each followed by its event
  std::vector<c10::Event> copied;
  copied.reserve(static_cast<size_t>(n_chunks));
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t off = c * chunk;
    const int64_t n = std::min<int64_t>(chunk, numel - off);
    host.narrow(0, off, n).copy_(flat.narrow(0, off, n), /*non_blocking=*/on_device);
    if (on_device) {
      copied.emplace_back(dev.type());
      copied.back().record(impl->getStream(dev));
    }
  }
  // 2. reduce each chunk once its copy is done; its host-to-device copy is queued behind the
  //    device-to-host copies, so it overlaps the reduction of the next chunks
  int rc = MPI_SUCCESS;
  char* base = static_cast<char*>(host.data_ptr());
  for (int64_t c = 0; c < n_chunks && rc == MPI_SUCCESS; ++c) {
    const int64_t off = c * chunk;
    const int64_t n = std::min<int64_t>(chunk, numel - off);
    if (on_device) {
      copied[static_cast<size_t>(c)].synchronize();
    }
    if (c == throw_at_chunk_) {  // test hook: an error inside the loop (as a CUDA error)
      throw std::runtime_error("ulfm staged all-reduce: test error at chunk " +
                               std::to_string(c));
    }
    rc = MPI_Allreduce(MPI_IN_PLACE, base + off * esize, static_cast<int>(n), type, op, comm_);
    if (rc == MPI_SUCCESS) {
      flat.narrow(0, off, n).copy_(host.narrow(0, off, n), /*non_blocking=*/on_device);
    }
  }
  // 3. the host buffer is reused by the next call and the caller may read the tensor on any
  //    stream: wait for the last host-to-device copy (one chunk's worth of tail latency)
  if (on_device) {
    c10::Event done(dev.type());
    done.record(impl->getStream(dev));
    done.synchronize();
  }
  guard.finished = true;  // a failed MPI call revokes in dataFailedLocked (rc != SUCCESS)
  if (rc == MPI_SUCCESS && !src.is_same(tensor)) {
    tensor.copy_(src);
  }
  return rc;
}

FailureRecord UlfmComm::broadcast(at::Tensor& tensor, int root) {
  checkDense(tensor, "broadcast");
  std::lock_guard<std::mutex> lk(mu_);
  auto g = lockGlobal();
  if (root < 0 || root >= size_) {
    throw std::invalid_argument("broadcast: root " + std::to_string(root) +
                                " is not a group rank (group size " + std::to_string(size_) +
                                ")");
  }
  FailureRecord rec = protocolLocked();
  if (!rec.ok) {
    last_ = rec;
    return rec;
  }
  DataBuffer buf(tensor);
  maybeKill(KillPoint::DATA);
  maybeKill(KillPoint::DATA_ASYNC);
  char* ptr = static_cast<char*>(buf.data());
  const int64_t nbytes = buf.numel() * buf.elementSize();
  int rc = MPI_SUCCESS;
  for (int64_t off = 0; off < nbytes && rc == MPI_SUCCESS; off += kMaxCount) {
    const int n = static_cast<int>(std::min<int64_t>(kMaxCount, nbytes - off));
    rc = MPI_Bcast(ptr + off, n, MPI_BYTE, root, comm_);
  }
  if (rc == MPI_SUCCESS) {
    buf.finish();
  }
  last_ = dataDoneLocked(rc, "MPI_Bcast", rec);
  return last_;
}

FailureRecord UlfmComm::consensus() {
  std::lock_guard<std::mutex> lk(mu_);
  auto g = lockGlobal();
  FailureRecord rec = protocolLocked();
  last_ = rec;
  return rec;
}

FailureRecord UlfmComm::barrier() {
  // MPIX_Comm_agree cannot complete anywhere before every live member has entered it, so the
  // Detect phase is already a barrier: a barrier is a consensus.
  return consensus();
}

} // namespace recover_hsdp
