// TETRAREC_CHECK(cond, "message ", value, ...): throw std::runtime_error (Python's
// RuntimeError) with the message when cond is false.
//
// Why not TORCH_CHECK: its formatted message is built with std::ostringstream, and in some
// environments (seen on a machine with torch 2.11.0+cu130 and g++ 13.3) any use of
// std::ostringstream in an extension crashes the process with a segmentation fault; a
// five-line extension with a formatted TORCH_CHECK did the same, while a
// std::runtime_error with a message joined by std::string raised as it should. So the
// message is joined here from strings, integers and dtypes, without streams.
#pragma once

#include <c10/core/ScalarType.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace tetrarec {

inline void append_part(std::string& s, const char* x) { s += x; }
inline void append_part(std::string& s, const std::string& x) { s += x; }
inline void append_part(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append_part(std::string& s, T x) {
  s += std::to_string(x);
}

template <typename... Args>
std::string check_message(const Args&... args) {
  std::string s;
  (append_part(s, args), ...);
  return s;
}

}  // namespace tetrarec

#define TETRAREC_CHECK(cond, ...)                                                   \
  do {                                                                              \
    if (!(cond)) throw std::runtime_error(::tetrarec::check_message(__VA_ARGS__));  \
  } while (0)
