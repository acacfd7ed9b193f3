// The Record phase's spare election: a pure function of data every survivor holds after the
// one Record collective, so every survivor computes the same result without further messages.
#pragma once

#include <cstdint>
#include <vector>

#include "ulfm_types.h"

// Internal to the extension module (also keeps pybind11's hidden types consistent).
#pragma GCC visibility push(hidden)
namespace recover_hsdp {

struct ElectionResult {
  std::vector<int32_t> roles;  // post-election role of every survivor, in old group-rank order
  Census census{};             // census of `roles`
  int64_t contrib = 0;
  bool at_boundary = false;
};

// roles[i]: the role of old group rank i before the failure; alive[i]: whether it survived;
// contributed[i]: its accumulated microbatches this iteration (ignored for the dead).
//
// For each dead MAJOR or BOUNDARY_MINOR (in group-rank order) the lowest-group-rank surviving
// MAJOR_SPARE not yet promoted becomes MAJOR; for each dead MINOR the lowest surviving
// MINOR_SPARE becomes MINOR; a dead spare needs no promotion. at_boundary iff some dead
// contributor cannot be replaced by a spare of its role. At a boundary NO promotion happens,
// every surviving spare is admitted and contrib sums every survivor's `contributed`; otherwise
// contrib sums `contributed` over the non-spare survivors (post-election: a promoted spare's
// microbatches count). Throws std::invalid_argument on malformed input.
ElectionResult elect(
    const std::vector<int32_t>& roles,
    const std::vector<bool>& alive,
    const std::vector<int64_t>& contributed);

} // namespace recover_hsdp
#pragma GCC visibility pop
