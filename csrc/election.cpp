#include "election.h"

#include <stdexcept>
#include <string>

namespace recover_hsdp {

Census censusOf(const std::vector<int32_t>& roles) {
  Census c{};
  for (int32_t r : roles) {
    if (!isValidRole(r)) {
      throw std::invalid_argument("invalid role " + std::to_string(r));
    }
    c[r] += 1;
  }
  return c;
}

ElectionResult elect(
    const std::vector<int32_t>& roles,
    const std::vector<bool>& alive,
    const std::vector<int64_t>& contributed) {
  const size_t n = roles.size();
  if (alive.size() != n || contributed.size() != n) {
    throw std::invalid_argument(
        "elect: roles, alive and contributed must have the same length (" +
        std::to_string(n) + ", " + std::to_string(alive.size()) + ", " +
        std::to_string(contributed.size()) + ")");
  }
  for (int32_t r : roles) {
    if (!isValidRole(r)) {
      throw std::invalid_argument("elect: invalid role " + std::to_string(r));
    }
  }

  constexpr auto MAJOR = static_cast<int32_t>(Role::MAJOR);
  constexpr auto MINOR = static_cast<int32_t>(Role::MINOR);
  constexpr auto MAJOR_SPARE = static_cast<int32_t>(Role::MAJOR_SPARE);
  constexpr auto MINOR_SPARE = static_cast<int32_t>(Role::MINOR_SPARE);
  constexpr auto BOUNDARY_MINOR = static_cast<int32_t>(Role::BOUNDARY_MINOR);

  // Vacancies per spare kind, and the surviving spares of each kind in group-rank order.
  size_t need_major = 0, need_minor = 0;
  std::vector<size_t> major_spares, minor_spares;
  for (size_t i = 0; i < n; ++i) {
    const int32_t r = roles[i];
    if (!alive[i]) {
      if (r == MAJOR || r == BOUNDARY_MINOR) {
        ++need_major;
      } else if (r == MINOR) {
        ++need_minor;
      }
    } else if (r == MAJOR_SPARE) {
      major_spares.push_back(i);
    } else if (r == MINOR_SPARE) {
      minor_spares.push_back(i);
    }
  }

  ElectionResult out;
  out.at_boundary = need_major > major_spares.size() || need_minor > minor_spares.size();

  std::vector<int32_t> after(roles);
  if (!out.at_boundary) {
    for (size_t k = 0; k < need_major; ++k) {
      after[major_spares[k]] = MAJOR;
    }
    for (size_t k = 0; k < need_minor; ++k) {
      after[minor_spares[k]] = MINOR;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!alive[i]) {
      continue;
    }
    out.roles.push_back(after[i]);
    if (out.at_boundary || !isSpare(after[i])) {
      out.contrib += contributed[i];
    }
  }
  out.census = censusOf(out.roles);
  return out;
}

} // namespace recover_hsdp
