// Plain data shared by the ULFM backend and its Python face.
//
// The Role integers are the wire format shared with recover_hsdp/types.py (Role IntEnum):
// MAJOR=0, MINOR=1, MAJOR_SPARE=2, MINOR_SPARE=3, BOUNDARY_MINOR=4. Never renumber them.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

// Internal to the extension module (also keeps pybind11's hidden types consistent).
#pragma GCC visibility push(hidden)
namespace recover_hsdp {

enum class Role : int32_t {
  MAJOR = 0,
  MINOR = 1,
  MAJOR_SPARE = 2,
  MINOR_SPARE = 3,
  BOUNDARY_MINOR = 4,
};

constexpr int kNumRoles = 5;

inline bool isValidRole(int32_t r) {
  return r >= 0 && r < kNumRoles;
}

inline bool isSpare(int32_t r) {
  return r == static_cast<int32_t>(Role::MAJOR_SPARE) ||
      r == static_cast<int32_t>(Role::MINOR_SPARE);
}

// Survivors per role, indexed by the Role integer.
using Census = std::array<int64_t, kNumRoles>;

Census censusOf(const std::vector<int32_t>& roles);

// What one ULFM collective call reports. Identical on every survivor of the call (except
// reduce_failed, which is this rank's own observation of a failed data phase; see UlfmComm).
struct FailureRecord {
  bool ok = true;
  bool quiesced = false;       // the call was a no-op because of the quiesce latch
  bool reduce_failed = false;  // Detect passed but the data phase failed here; comm revoked
  std::vector<int64_t> failed_ranks;  // MPI_COMM_WORLD ranks lost during this call
  int64_t epoch = 0;
  Census census{};      // survivors per role (post-election)
  int64_t contrib = 0;  // contribution total of the survivors (see election.h)
  bool at_boundary = false;
  std::vector<int32_t> roles;  // post-election role of every member, group-rank order
};

} // namespace recover_hsdp
#pragma GCC visibility pop
