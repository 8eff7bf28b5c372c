// flashattn/error.h — the one exception type every entry point throws (SPEC §5).
#pragma once

#include <stdexcept>
#include <string>

namespace flashattn {

// Thrown for every invalid call. The message names the argument, the rule, and the expected and
// actual values. When it is thrown, no output tensor has been written.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

}  // namespace flashattn
