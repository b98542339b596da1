// Status: the internal result type. Every fallible internal function returns one (or a Result<T>);
// the C API turns it into an odcResult_t plus a last-error message. A Status is never dropped
// silently: it is [[nodiscard]].
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace odc {

// Internal error categories; they map one-to-one onto odcResult_t at the C API boundary.
enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller passed something wrong; nothing was changed
  kSystemError,      // the OS refused (file, memory, ...)
  kInternalError,    // a bug in odc
  kInvalidUsage,     // a valid call at the wrong moment (outside a minibatch, after destroy, ...)
  kTimeout,          // a wait on another rank ran past the communicator's timeout
  kRemoteError,      // another rank died or failed
  kInterrupted,      // a wait ended from outside (the caller's interrupt check, a destroy)
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string message) {
    return Status(StatusCode::kInvalidArgument, std::move(message));
  }
  static Status SystemError(std::string message) {
    return Status(StatusCode::kSystemError, std::move(message));
  }
  static Status InternalError(std::string message) {
    return Status(StatusCode::kInternalError, std::move(message));
  }
  static Status InvalidUsage(std::string message) {
    return Status(StatusCode::kInvalidUsage, std::move(message));
  }
  static Status Timeout(std::string message) {
    return Status(StatusCode::kTimeout, std::move(message));
  }
  static Status RemoteError(std::string message) {
    return Status(StatusCode::kRemoteError, std::move(message));
  }
  static Status Interrupted(std::string message) {
    return Status(StatusCode::kInterrupted, std::move(message));
  }

  // The same status with `context` prepended to the message ("rank 2: minibatch_end: ...").
  Status with_context(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design, like std::optional
  Result(Status status) : value_(std::move(status)) {}  // NOLINT

  bool ok() const { return std::holds_alternative<T>(value_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(value_);
  }
  T& value() & { return std::get<T>(value_); }
  const T& value() const& { return std::get<T>(value_); }
  T&& value() && { return std::get<T>(std::move(value_)); }

 private:
  std::variant<T, Status> value_;
};

}  // namespace odc

// Returns the Status from the enclosing function when `expr` fails.
#define ODC_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::odc::Status odc_status_ = (expr);        \
    if (!odc_status_.ok()) return odc_status_; \
  } while (0)
