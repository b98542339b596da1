// Shared-memory bootstrap (see shm_bootstrap.h). Each rank writes only its own control block
// (single writer); peers read it. A collective is an arrival word (the epoch) stored with release
// semantics after the collective's name and record, plus a futex word bumped after it, so waiting
// ranks sleep in the kernel instead of spinning. Two alternating slots suffice for name and record:
// no rank can enter collective e+2 before every rank has left collective e.
#include "bootstrap/shm_bootstrap.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <thread>

#include "common/deadline.h"
#include "common/interrupt.h"

namespace odc::shm {

namespace {
constexpr uint64_t kMagic = 0x356d68732d63646fULL;  // "odc-shm5"
constexpr size_t kRecordBytes = 256;                // one allgather round per rank
constexpr size_t kOperationBytes = 48;

enum BlockState : uint32_t { kStarting = 0, kAlive = 1, kFailed = 2, kClosed = 3 };
}  // namespace

struct ControlBlock {
  std::atomic<uint64_t> magic;  // kMagic once every other field is set
  uint32_t world_size;
  int32_t rank;
  int32_t pid;
  std::atomic<uint32_t> state;
  std::atomic<uint64_t> num_allocations;      // allocation segments named so far (for cleanup)
  uint64_t pid_namespace;                     // inode of /proc/self/ns/pid; 0: unknown
  alignas(64) std::atomic<uint64_t> arrival;  // collectives entered so far
  std::atomic<uint32_t> wake;                 // futex word, bumped after every arrival or signal
  std::atomic<uint32_t> inbox;  // futex word, bumped by a peer after each signal to this rank
  std::atomic<uint32_t> inbox_sleepers;  // ranks' threads in futex_wait on `inbox` right now
  alignas(64) unsigned char records[2][kRecordBytes];  // allgather rounds, alternating
  char operations[2][kOperationBytes];                 // collective names, alternating
  char failure[256];                                   // why this rank failed (kFailed)
  // The launch that started this rank (create's `launch`): its start for messages ("" when none),
  // and a hash of all of it, which tells launches apart however long their identities are.
  char launch[160];
  uint64_t launch_hash;
  // When this rank would stop waiting for its peers to join (seconds since the epoch; infinite
  // with an infinite timeout), and whether it joins a split group (whose members all come
  // straight from the parent's exchange): when a dead rank's block is debris (reclaim_debris).
  double join_deadline;
  uint32_t split_group;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "cross-process atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "cross-process atomics must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word must be 32 bits");

namespace {

using Clock = ShmBootstrap::Clock;

// How long a block whose owner is dead may stay before a waiting peer calls that rank dead: its
// own rank, restarting with the same key, removes such a leftover within milliseconds.
constexpr auto kDeadBlockGrace = std::chrono::seconds(2);

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto nanos = std::max<int64_t>(timeout.count(), 0);
  timespec relative{static_cast<time_t>(nanos / 1000000000), static_cast<long>(nanos % 1000000000)};
  // Shared (not FUTEX_PRIVATE) because the word lives in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &relative, nullptr,
          0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// This process's PID namespace (the inode of /proc/self/ns/pid), 0 when it cannot be read. Ranks in
// different PID namespaces cannot check each other's liveness by pid (the numbers mean nothing
// across them), so the join refuses them instead of reporting a live peer dead.
uint64_t own_pid_namespace() {
  // A process never changes its own PID namespace (setns moves only its later children).
  static const uint64_t inode = [] {
    struct stat info {};
    if (::stat("/proc/self/ns/pid", &info) != 0) return uint64_t{0};
    return static_cast<uint64_t>(info.st_ino);
  }();
  return inode;
}

// True when `pid` exists and is not a zombie (a dead child its parent has not reaped yet).
bool pid_alive(int32_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
  const size_t close_paren = line.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= line.size()) return true;
  const char state = line[close_paren + 2];
  return state != 'Z' && state != 'X';
}

bool valid_key(const std::string& key) {
  if (key.empty() || key.size() > 200) return false;
  return std::all_of(key.begin(), key.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

double seconds_since_epoch() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Clock::duration until(Clock::time_point deadline, Clock::duration at_most) {
  const auto now = Clock::now();
  if (deadline <= now) return Clock::duration::zero();
  return std::min<Clock::duration>(deadline - now, at_most);
}

// 64-bit FNV-1a.
uint64_t hash_of(const std::string& text) {
  uint64_t hash = 1469598103934665603ULL;
  for (const char c : text) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  return hash;
}

// A block's launch identity as messages show it ("none" when empty; "..." when cut).
std::string launch_text(const ControlBlock& block) {
  const size_t length = strnlen(block.launch, sizeof(block.launch));
  if (length == 0) return "none";
  return std::string(block.launch, length) + (length == sizeof(block.launch) - 1 ? "..." : "");
}

// The abstract Unix socket address of a rank's claim (per user, key and rank; no file). Keys too
// long for sun_path are replaced by their 64-bit FNV-1a hash.
std::pair<sockaddr_un, socklen_t> claim_address(const std::string& key, int rank) {
  std::string id = key;
  sockaddr_un address{};
  const std::string fixed = "odc/" + std::to_string(::geteuid()) + "//r" + std::to_string(rank);
  if (fixed.size() + id.size() + 1 > sizeof(address.sun_path)) {
    const uint64_t hash = hash_of(key);
    char hex[24];
    std::snprintf(hex, sizeof(hex), "#%016llx", static_cast<unsigned long long>(hash));
    id = hex;
  }
  const std::string name =
      "odc/" + std::to_string(::geteuid()) + "/" + id + "/r" + std::to_string(rank);
  address.sun_family = AF_UNIX;
  address.sun_path[0] = '\0';  // abstract: released by the kernel with the last descriptor
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  return {address, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
}

// Claims held by this process. A forked child (a DataLoader worker, a launcher's rank) would hold
// them as long as it lives: in the child, each is replaced by /dev/null at once.
std::mutex claims_mutex;
std::set<int>* claim_fds = nullptr;

void release_claims_in_child() {
  if (claim_fds == nullptr) return;  // the lock is not taken: the child has one thread
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) return;
  for (const int fd : *claim_fds) (void)::dup3(null_fd, fd, O_CLOEXEC);
  ::close(null_fd);
}

void track_claim(int fd, bool open) {
  std::lock_guard<std::mutex> lock(claims_mutex);
  if (claim_fds == nullptr) {
    claim_fds = new std::set<int>();
    ::pthread_atfork(nullptr, nullptr, release_claims_in_child);
  }
  if (open) {
    claim_fds->insert(fd);
  } else {
    claim_fds->erase(fd);
  }
}

constexpr const char* kOwnKeyAdvice =
    ": give every job its own key (odc.launch and odc.torch.comm_from_process_group draw one "
    "per job; docs/runtime.md)";
// Told to the holder of a slot, which reads it only while its own ranks are still joining
// (check_claim drops it once they have all met): then both jobs do fail.
constexpr const char* kBothFail =
    "; this job's ranks had not all met yet, so both jobs fail rather than pair ranks across jobs "
    "(a job whose ranks have all met goes on)";
// Returned to a rank refused while it joins: it cannot tell whether the other job's ranks had all
// met (the other job reads the collision only while it is still joining), so it says both cases.
constexpr const char* kRefusedHere =
    ": this rank is refused (it has not joined); the other job goes on if its ranks had all met, "
    "else it fails too rather than pair ranks across jobs";

// Control names of the bootstraps alive in this process, removed at exit when their owner never
// closed them (a Python process that ends without close()). Each with the pid that made it: a
// forked child that exits normally must not remove its parent's names.
std::mutex open_names_mutex;
std::map<std::string, pid_t>* open_names = nullptr;

void remove_open_names_at_exit() {
  std::lock_guard<std::mutex> lock(open_names_mutex);
  if (open_names == nullptr) return;
  for (const auto& [name, owner] : *open_names) {
    if (owner == ::getpid()) (void)Segment::unlink_name(name);
  }
}

void track_open_name(const std::string& name, bool open) {
  std::lock_guard<std::mutex> lock(open_names_mutex);
  if (open_names == nullptr) {
    open_names = new std::map<std::string, pid_t>();
    std::atexit(remove_open_names_at_exit);
  }
  if (open) {
    (*open_names)[name] = ::getpid();
  } else {
    open_names->erase(name);
  }
}

}  // namespace

ShmBootstrap::ShmBootstrap(int rank, int world_size, std::string key,
                           std::chrono::duration<double> timeout)
    : rank_(rank), world_size_(world_size), key_(std::move(key)), timeout_(timeout) {
  controls_.resize(static_cast<size_t>(world_size));
}

Result<std::shared_ptr<ShmBootstrap>> ShmBootstrap::create(
    int rank, int world_size, const std::string& key, std::chrono::duration<double> timeout,
    Bootstrap* outer, const SplitParent* parent, const std::string& launch) {
  if (world_size < 1) {
    return Status::InvalidArgument("world size must be at least 1, got " +
                                   std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is outside world size " +
                                   std::to_string(world_size));
  }
  if (!valid_key(key)) {
    return Status::InvalidArgument("invalid key '" + key +
                                   "': use 1 to 200 letters, digits, '_', '-' or '.'");
  }
  if (!(timeout.count() > 0)) {
    return Status::InvalidArgument("timeout must be positive (or infinite), got " +
                                   std::to_string(timeout.count()) + " s");
  }
  // A job starting on this host removes what killed jobs left (a split's members, whose job has
  // started, need not look again).
  if (parent == nullptr) (void)reclaim_debris();
  std::shared_ptr<ShmBootstrap> bootstrap(new ShmBootstrap(rank, world_size, key, timeout));
  bootstrap->launch_ = launch;
  bootstrap->split_group_ = parent != nullptr;
  if (Status status = bootstrap->join(outer, parent); !status.ok()) {
    bootstrap->mark_failed("init: " + status.message());
    if (bootstrap->leave_block_ && !bootstrap->foreign_peer_knows()) {
      bootstrap->controls_[rank]->keep_name();
    }
    return status;
  }
  return bootstrap;
}

ShmBootstrap::~ShmBootstrap() {
  if (claim_fd_ >= 0) {  // the slot is free for the next claimant
    track_claim(claim_fd_, false);
    ::close(claim_fd_);
  }
  if (!controls_[rank_]) return;
  ControlBlock& own = block(rank_);
  uint32_t expected = kAlive;
  own.state.compare_exchange_strong(expected, kClosed, std::memory_order_acq_rel);
  own.wake.fetch_add(1, std::memory_order_release);
  futex_wake_all(&own.wake);
  // Peers that died without anyone noticing leave nothing behind either.
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_ || !controls_[peer]) continue;
    const ControlBlock& other = block(peer);
    if (!pid_alive(other.pid)) {
      remove_remains(peer, other.pid, other.num_allocations.load(std::memory_order_acquire));
    }
  }
  track_open_name(controls_[rank_]->name(), false);
  // controls_[rank_] unlinks our name when it goes (if init did not); the claim ends below.
}

bool ShmBootstrap::foreign_peer_knows() const {
  // Each of the two ranks marked itself failed before asking, so when both saw each other at
  // once the later one to ask finds the other failed (or its block already removed) and removes
  // both blocks; the earlier one keeps its block for the later one to read.
  auto opened = Segment::open(segment_name(foreign_peer_, ""), sizeof(ControlBlock));
  if (!opened.ok()) return true;  // gone: the peer knew, and removed it (and ours)
  const auto* peer_block = static_cast<const ControlBlock*>(opened.value()->data());
  if (peer_block->magic.load(std::memory_order_acquire) != kMagic ||
      peer_block->state.load(std::memory_order_acquire) != kFailed) {
    return false;
  }
  remove_remains(foreign_peer_, peer_block->pid, 0);
  return true;
}

ControlBlock& ShmBootstrap::block(int rank) const {
  return *static_cast<ControlBlock*>(controls_[static_cast<size_t>(rank)]->data());
}

std::string ShmBootstrap::segment_name(int rank, const std::string& suffix) const {
  return "/odc." + key_ + ".r" + std::to_string(rank) + suffix;
}

namespace {

// The suffix of an allocation segment's name (ShmBootstrap::allocation_name).
std::string allocation_suffix(uint64_t index, int32_t pid, uint64_t pid_namespace) {
  return ".a" + std::to_string(index) + ".p" + std::to_string(pid) + ".n" +
         std::to_string(pid_namespace);
}

}  // namespace

std::string ShmBootstrap::allocation_name(int rank, uint64_t index) const {
  const ControlBlock& owner = block(rank);
  return segment_name(rank, allocation_suffix(index, owner.pid, owner.pid_namespace));
}

Status ShmBootstrap::claim_rank() {
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status::SystemError(std::string("socket(AF_UNIX) failed: ") + strerror(errno));
  // The kernel attaches each sender's credentials: only this user's processes are heard.
  const int on = 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &on, sizeof(on));
  const auto [address, length] = claim_address(key_, rank_);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), length) == 0) {
    claim_fd_ = fd;
    track_claim(fd, true);
    return Status::Ok();
  }
  const int error = errno;
  ::close(fd);
  if (error != EADDRINUSE) {
    return Status::SystemError("claiming rank " + std::to_string(rank_) + " of key '" + key_ +
                               "' failed: bind: " + strerror(error));
  }
  // The holder may have paired with ranks of this job (both started at once): unless its ranks
  // had all met before (check_claim), it must fail too.
  notify_collision(rank_, "another job is using key '" + key_ + "': process " +
                              std::to_string(::getpid()) + " also claimed rank " +
                              std::to_string(rank_) + kBothFail + kOwnKeyAdvice);
  return Status::InvalidUsage(
      "another job is using key '" + key_ + "': rank " + std::to_string(rank_) +
      " of it is held by a live process (the key is in use)" + kRefusedHere + kOwnKeyAdvice);
}

void ShmBootstrap::notify_collision(int peer, const std::string& reason) const {
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;  // the holder then fails when its own peers do, or times out
  const auto [address, length] = claim_address(key_, peer);
  (void)::sendto(fd, reason.data(), std::min<size_t>(reason.size(), 1000), MSG_DONTWAIT,
                 reinterpret_cast<const sockaddr*>(&address), length);
  ::close(fd);
}

Status ShmBootstrap::check_claim() {
  while (collision_.empty() && claim_fd_ >= 0) {
    char text[1024];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
    iovec io{text, sizeof(text)};
    msghdr message{};
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t got = ::recvmsg(claim_fd_, &message, MSG_DONTWAIT);
    if (got < 0) return Status::Ok();  // nothing pending (EAGAIN)
    // Every rank of this job had met before this claim: its ranks are fixed, the claimant is
    // not one of them, and its own init fails. Read and dropped, so the queue stays empty.
    if (met_) continue;
    bool same_user = false;
    for (cmsghdr* part = CMSG_FIRSTHDR(&message); part != nullptr;
         part = CMSG_NXTHDR(&message, part)) {
      if (part->cmsg_level != SOL_SOCKET || part->cmsg_type != SCM_CREDENTIALS) continue;
      ucred sender{};
      std::memcpy(&sender, CMSG_DATA(part), sizeof(sender));
      same_user = sender.uid == ::geteuid();
    }
    if (!same_user) continue;  // another user's process cannot end this job
    collision_.assign(text, static_cast<size_t>(got));
    if (collision_.empty()) collision_ = "another job is using key '" + key_ + "'";
    mark_failed(collision_);
  }
  if (collision_.empty()) return Status::Ok();
  return Status::InvalidUsage(collision_);
}

void ShmBootstrap::note_allocations(uint64_t count) {
  block(rank_).num_allocations.store(count, std::memory_order_release);
}

void ShmBootstrap::remove_remains(int peer, int32_t dead_pid, uint64_t num_allocations) const {
  // The dead rank was of this job, so of this rank's PID namespace (the join checks it).
  const uint64_t pid_namespace = own_pid_namespace();
  for (uint64_t i = 0; i < num_allocations; ++i) {
    (void)Segment::unlink_name(segment_name(peer, allocation_suffix(i, dead_pid, pid_namespace)));
  }
  // The control name only if it is still the dead rank's (a restarted rank may own it now).
  const std::string name = segment_name(peer, "");
  auto current = Segment::open(name, sizeof(ControlBlock));
  if (!current.ok()) return;
  const auto* found = static_cast<const ControlBlock*>(current.value()->data());
  if (found->magic.load(std::memory_order_acquire) == kMagic && found->pid == dead_pid) {
    (void)Segment::unlink_name(name);
  }
}

int ShmBootstrap::reclaim_debris() {
  DIR* directory = ::opendir("/dev/shm");
  if (directory == nullptr) return 0;
  const uint64_t own_namespace = own_pid_namespace();
  if (own_namespace == 0) {  // pids cannot be told apart from another namespace's: leave all
    ::closedir(directory);
    return 0;
  }
  const auto now = std::chrono::system_clock::now();
  auto digits_after = [](const std::string& name, size_t at, uint64_t& value) {
    if (at >= name.size()) return false;
    value = 0;
    for (size_t i = at; i < name.size(); ++i) {
      if (!std::isdigit(static_cast<unsigned char>(name[i])) || value > (UINT64_MAX - 9) / 10) {
        return false;
      }
      value = value * 10 + static_cast<uint64_t>(name[i] - '0');
    }
    return true;
  };
  struct Found {
    std::string name;
    int32_t pid;
  };
  std::map<std::string, std::vector<Found>> dead_blocks;  // by key: blocks of dead owners
  std::set<std::string> live_keys;                        // keys with a block of a live owner
  std::vector<std::string> removable;
  while (const dirent* entry = ::readdir(directory)) {
    const std::string name = entry->d_name;
    if (name.rfind("odc.", 0) != 0) continue;
    struct stat info {};
    if (::fstatat(::dirfd(directory), name.c_str(), &info, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(info.st_mode) || info.st_uid != ::geteuid()) {
      continue;  // not ours
    }
    // "...<.a index>.p<pid>.n<namespace>": an allocation segment, whose creator the name tells.
    const size_t dot_n = name.rfind(".n");
    const size_t dot_p = dot_n == std::string::npos ? dot_n : name.rfind(".p", dot_n);
    uint64_t pid_namespace = 0;
    uint64_t pid = 0;
    if (dot_p != std::string::npos && digits_after(name, dot_n + 2, pid_namespace) &&
        digits_after(name.substr(0, dot_n), dot_p + 2, pid) && pid <= INT32_MAX) {
      if (pid_namespace == own_namespace && !pid_alive(static_cast<int32_t>(pid))) {
        removable.push_back("/" + name);
      }
      continue;
    }
    // "odc.<key>.r<rank>": a control block, whose creator it records.
    const size_t dot_r = name.rfind(".r");
    uint64_t rank = 0;
    if (dot_r == std::string::npos || dot_r <= 4 || !digits_after(name, dot_r + 2, rank)) continue;
    const std::string key = name.substr(4, dot_r - 4);
    auto opened = Segment::open("/" + name, sizeof(ControlBlock));
    if (!opened.ok()) {
      // Never sized: its creator was killed within microseconds of making it, or is making it
      // now. A minute later it is debris.
      const auto made = std::chrono::system_clock::from_time_t(info.st_ctime);
      if (info.st_size == 0 && now - made > std::chrono::minutes(1)) {
        removable.push_back("/" + name);
      }
      continue;
    }
    const auto* found = static_cast<const ControlBlock*>(opened.value()->data());
    const uint64_t magic = found->magic.load(std::memory_order_acquire);
    if (magic != kMagic) {  // never initialized (as above), or another odc version's: left alone
      const auto made = std::chrono::system_clock::from_time_t(info.st_ctime);
      if (magic == 0 && now - made > std::chrono::minutes(1)) removable.push_back("/" + name);
      continue;
    }
    if (found->pid_namespace != own_namespace) continue;
    if (pid_alive(found->pid)) {
      live_keys.insert(key);
    } else if (found->split_group != 0 || found->join_deadline < seconds_since_epoch()) {
      // Debris, unless peers of the dead rank may still come to join and should learn that it
      // died: a split group's members come straight from the parent's exchange (and see its
      // death there too); a job's ranks may start later, until the dead rank's own timeout.
      dead_blocks[key].push_back({"/" + name, found->pid});
    }
  }
  ::closedir(directory);
  // A key with a live rank still in init: that rank removes its dead peers' blocks itself, after
  // naming them (docs/runtime.md); a key whose named ranks are all dead is a killed job's.
  for (const auto& [key, blocks] : dead_blocks) {
    if (live_keys.count(key) != 0) continue;
    for (const Found& block : blocks) {
      // Only if it is still the dead owner's (a restarting rank may have replaced it).
      auto current = Segment::open(block.name, sizeof(ControlBlock));
      if (!current.ok()) continue;
      const auto* found = static_cast<const ControlBlock*>(current.value()->data());
      if (found->magic.load(std::memory_order_acquire) == kMagic && found->pid == block.pid) {
        removable.push_back(block.name);
      }
    }
  }
  int removed = 0;
  std::string example;
  for (const std::string& name : removable) {
    if (::shm_unlink(name.c_str()) != 0) continue;  // another job's init removed it first
    if (removed++ == 0) example = name;
  }
  if (removed > 0) {
    std::fprintf(stderr, "odc: removed %d name(s) that dead processes left in /dev/shm (e.g. %s)\n",
                 removed, example.c_str());
  }
  return removed;
}

Status ShmBootstrap::create_control_segment() {
  const std::string name = segment_name(rank_, "");
  // A segment that exists but was never initialized may belong to a rank that is still starting:
  // give it this long before treating it as debris of a crash.
  const auto grace_deadline = Clock::now() + std::chrono::seconds(1);
  for (int reclaimed = 0; reclaimed < 4;) {
    auto created = Segment::create(name, sizeof(ControlBlock));
    if (created.ok()) {
      auto* own = new (created.value()->data()) ControlBlock{};
      own->world_size = static_cast<uint32_t>(world_size_);
      own->rank = rank_;
      own->pid = static_cast<int32_t>(::getpid());
      own->pid_namespace = own_pid_namespace();
      std::memcpy(own->launch, launch_.data(), std::min(launch_.size(), sizeof(own->launch) - 1));
      own->launch_hash = hash_of(launch_);
      own->join_deadline = seconds_since_epoch() + timeout_.count();  // inf stays inf
      own->split_group = split_group_ ? 1 : 0;
      own->state.store(kAlive, std::memory_order_relaxed);
      own->magic.store(kMagic, std::memory_order_release);
      controls_[rank_] = std::move(created).value();
      track_open_name(name, true);
      return Status::Ok();
    }
    if (created.status().code() != StatusCode::kInvalidArgument) return created.status();

    auto existing = Segment::open(name, sizeof(ControlBlock));
    if (!existing.ok()) {
      if (existing.status().code() == StatusCode::kInvalidUsage && Clock::now() < grace_deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;  // vanished or still being sized: look again
      }
      if (existing.status().code() != StatusCode::kInvalidUsage) return existing.status();
    } else {
      auto* old = static_cast<ControlBlock*>(existing.value()->data());
      if (old->magic.load(std::memory_order_acquire) == kMagic) {
        const uint32_t state = old->state.load(std::memory_order_acquire);
        if (pid_alive(old->pid) && (state == kAlive || state == kStarting)) {
          return Status::InvalidUsage("key '" + key_ + "' is in use: rank " +
                                      std::to_string(rank_) + " is held by live process " +
                                      std::to_string(old->pid) +
                                      "; use another key or end that process");
        }
        remove_remains(rank_, old->pid, old->num_allocations.load(std::memory_order_acquire));
        std::fprintf(stderr, "odc: reclaimed shared memory of key '%s' rank %d left by pid %d\n",
                     key_.c_str(), rank_, old->pid);
      } else if (Clock::now() < grace_deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
    }
    ODC_RETURN_IF_ERROR(Segment::unlink_name(name));
    ++reclaimed;
  }
  return Status::SystemError("could not create shared memory segment " + name +
                             ": it keeps reappearing");
}

Result<bool> ShmBootstrap::try_map_peer(int peer, Clock::time_point& dead_since) {
  auto opened = Segment::open(segment_name(peer, ""), sizeof(ControlBlock));
  if (!opened.ok()) {
    if (opened.status().code() != StatusCode::kInvalidUsage) return opened.status();
    dead_since = Clock::time_point{};  // not there (yet, or no more)
    return false;
  }
  auto* peer_block = static_cast<ControlBlock*>(opened.value()->data());
  if (peer_block->magic.load(std::memory_order_acquire) != kMagic) return false;  // being made
  const uint64_t own_namespace = block(rank_).pid_namespace;
  if (peer_block->pid_namespace != own_namespace && peer_block->pid_namespace != 0 &&
      own_namespace != 0) {
    // Whichever of the two ranks sees the other first fails and leaves its block named, so the
    // other sees it and fails with the same line (and removes it) instead of waiting for it.
    if (peer_block->state.load(std::memory_order_acquire) == kFailed) {
      remove_remains(peer, peer_block->pid, 0);
    } else {
      leave_block_ = true;
      foreign_peer_ = peer;
    }
    return Status::InvalidUsage(
        "rank " + std::to_string(peer) + " (pid " + std::to_string(peer_block->pid) +
        " of PID namespace pid:[" + std::to_string(peer_block->pid_namespace) +
        "]) runs in another PID namespace than this rank (pid:[" + std::to_string(own_namespace) +
        "]): local ranks must share one PID namespace, as odc checks its peers' liveness by pid "
        "(e.g. run them in one container, or with docker --pid=host; docs/runtime.md)");
  }
  if (pid_alive(peer_block->pid)) {
    const ControlBlock& own = block(rank_);
    if (peer_block->launch_hash != own.launch_hash ||
        strncmp(peer_block->launch, own.launch, sizeof(own.launch)) != 0) {
      // Two launched jobs with one key: both ranks fail (the peer is told, as it may not have
      // mapped this block yet), whatever the order in which their ranks came.
      const std::string theirs = launch_text(*peer_block);
      const std::string ours = launch_text(own);
      const std::string mine = std::to_string(::getpid());
      notify_collision(peer, "another job is using key '" + key_ + "': rank " +
                                 std::to_string(rank_) + " (pid " + mine +
                                 ") was started by another launch (its " + ours + "; this rank's " +
                                 theirs + ")" + kBothFail + kOwnKeyAdvice);
      return Status::InvalidUsage(
          "another job is using key '" + key_ + "': rank " + std::to_string(peer) + " (pid " +
          std::to_string(peer_block->pid) + ") was started by another launch (its " + theirs +
          "; this rank's " + ours + ")" + kRefusedHere + kOwnKeyAdvice);
    }
    if (peer_block->world_size != static_cast<uint32_t>(world_size_)) {
      return Status::InvalidArgument("rank " + std::to_string(peer) + " joined key '" + key_ +
                                     "' with world size " + std::to_string(peer_block->world_size) +
                                     ", this rank with " + std::to_string(world_size_));
    }
    controls_[peer] = std::move(opened).value();
    return true;
  }
  // Its owner is dead: debris of an earlier crash that the restarting rank removes at once, or a
  // rank of this job that died during init. Past the grace period: the latter.
  const auto now = Clock::now();
  if (dead_since == Clock::time_point{}) dead_since = now;
  if (now - dead_since < kDeadBlockGrace) return false;
  const int32_t dead_pid = peer_block->pid;
  remove_remains(peer, dead_pid, peer_block->num_allocations.load(std::memory_order_acquire));
  return Status::RemoteError("rank " + std::to_string(peer) + " (pid " + std::to_string(dead_pid) +
                             ") died before every rank joined key '" + key_ +
                             "' (what it left in /dev/shm is removed)");
}

Status ShmBootstrap::check_parent(const SplitParent& parent) const {
  // This rank's own parent first: one that failed meanwhile (an abort on another thread, or
  // from its interrupt check) does not complete the split either.
  const int mine = parent.members[static_cast<size_t>(rank_)];
  if (Status status = parent.bootstrap->peer_status(mine); !status.ok()) {
    return Status::RemoteError(
        "the communicator this rank splits failed before the split's "
        "members met (" +
        status.message() + ")");
  }
  for (int member = 0; member < world_size_; ++member) {
    if (member == rank_) continue;
    const int theirs = parent.members[static_cast<size_t>(member)];
    if (Status status = parent.bootstrap->peer_status(theirs); !status.ok()) {
      return Status::RemoteError("rank " + std::to_string(theirs) +
                                 " will not meet the other members of the split (" +
                                 status.message() + ")");
    }
  }
  return Status::Ok();
}

Status ShmBootstrap::join(Bootstrap* outer, const SplitParent* parent) {
  if (parent != nullptr) ODC_RETURN_IF_ERROR(check_parent(*parent));
  // The claim first: a second claimant never makes a block, so no job maps it.
  ODC_RETURN_IF_ERROR(claim_rank());
  ODC_RETURN_IF_ERROR(create_control_segment());
  // With an outer bootstrap, a rank that fails before its block exists tells its peers there
  // (mark_failed); they would otherwise look for the block until the timeout. Past this barrier
  // every block exists, and a rank that fails later marks its own block failed.
  if (outer != nullptr) ODC_RETURN_IF_ERROR(outer->barrier("shm control blocks"));
  const auto deadline = deadline_after(timeout_);
  // Every missing peer is looked for in each round, not one after another: a rank that finds a
  // dead peer removes its block, and a rank that had not met the finder yet would then only see
  // a peer that never joined. Met ranks are mapped, so their failure reasons reach us.
  std::vector<Clock::time_point> dead_since(static_cast<size_t>(world_size_));
  auto pause = std::chrono::milliseconds(1);
  auto next_parent_check = Clock::now();
  while (true) {
    int first_missing = -1;
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer == rank_ || controls_[peer]) continue;
      auto mapped = try_map_peer(peer, dead_since[static_cast<size_t>(peer)]);
      if (!mapped.ok()) return mapped.status();
      if (mapped.value()) {
        pause = std::chrono::milliseconds(1);
      } else if (first_missing < 0) {
        first_missing = peer;
      }
    }
    if (first_missing < 0) break;
    ODC_RETURN_IF_ERROR(check_claim());
    // A member that failed or died in the parent after its colour record went out never makes
    // its block here: its failure flag and pid there say so (reads /proc: every 10 ms at most).
    if (parent != nullptr && Clock::now() >= next_parent_check) {
      ODC_RETURN_IF_ERROR(check_parent(*parent));
      next_parent_check = Clock::now() + std::chrono::milliseconds(10);
    }
    // A rank already met may have given up (e.g. it found a peer dead and removed its block):
    // end with its reason rather than wait for a rank that will never come.
    for (int other = 0; other < world_size_; ++other) {
      if (other == rank_ || !controls_[other]) continue;
      const ControlBlock& met = block(other);
      if (met.state.load(std::memory_order_acquire) == kFailed) {
        return Status::RemoteError(
            "rank " + std::to_string(other) +
            " failed: " + std::string(met.failure, strnlen(met.failure, sizeof(met.failure))));
      }
    }
    if (Clock::now() >= deadline) {
      return Status::Timeout("timed out after " + timeout_text(timeout_) + " waiting for rank " +
                             std::to_string(first_missing) + " to join key '" + key_ + "'");
    }
    ODC_RETURN_IF_ERROR(poll_interrupt("waiting for rank " + std::to_string(first_missing) +
                                       " to join key '" + key_ + "'"));
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
  ODC_RETURN_IF_ERROR(arrive_and_wait("init"));
  // Every rank arrived, so every rank has mapped every block: no name is needed any more. Each
  // rank removes every rank's, so a rank killed now (torchrun's SIGTERM) leaves nothing named.
  for (const auto& control : controls_) (void)control->remove_name();
  track_open_name(controls_[rank_]->name(), false);
  // Every slot is held by a rank of this job now. A claim that collided before this read (the
  // same instant) still fails this job; any later one is another job's alone (check_claim).
  ODC_RETURN_IF_ERROR(check_claim());
  met_ = true;
  return Status::Ok();
}

uint32_t ShmBootstrap::wake_count(int peer) const {
  return block(peer).wake.load(std::memory_order_acquire);
}

void ShmBootstrap::sleep_on(int peer, uint32_t seen, Clock::duration limit) const {
  futex_wait(&block(peer).wake, seen, std::chrono::duration_cast<std::chrono::nanoseconds>(limit));
}

uint32_t ShmBootstrap::inbox_count() const {
  return block(rank_).inbox.load(std::memory_order_acquire);
}

void ShmBootstrap::sleep_on_inbox(uint32_t seen, Clock::duration limit) const {
  ControlBlock& own = block(rank_);
  own.inbox_sleepers.fetch_add(1, std::memory_order_seq_cst);
  futex_wait(&own.inbox, seen, std::chrono::duration_cast<std::chrono::nanoseconds>(limit));
  own.inbox_sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void ShmBootstrap::wake_inbox(int peer) {
  ControlBlock& other = block(peer);
  other.inbox.fetch_add(1, std::memory_order_seq_cst);
  // No sleeper now: none to wake (a syscall saved per signal). One that comes after the bump
  // either read the word after it (and checks its slots before sleeping) or before it (and its
  // futex_wait sees the word changed and returns at once).
  if (other.inbox_sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&other.inbox);
}

void ShmBootstrap::wake_peers() {
  ControlBlock& own = block(rank_);
  own.wake.fetch_add(1, std::memory_order_release);
  futex_wake_all(&own.wake);
}

Status ShmBootstrap::peer_status(int peer) {
  const ControlBlock& other = block(peer);
  const std::string who = "rank " + std::to_string(peer);
  const uint32_t state = other.state.load(std::memory_order_acquire);
  if (state == kFailed) {
    const std::string reason(other.failure, strnlen(other.failure, sizeof(other.failure)));
    return Status::RemoteError(who + " failed: " + reason);
  }
  if (state == kClosed) return Status::RemoteError(who + " destroyed its communicator");
  if (!pid_alive(other.pid)) {
    remove_remains(peer, other.pid, other.num_allocations.load(std::memory_order_acquire));
    return Status::RemoteError(who + " (pid " + std::to_string(other.pid) + ") died");
  }
  return Status::Ok();
}

Status ShmBootstrap::arrive_and_wait(const char* operation) {
  ODC_RETURN_IF_ERROR(check_claim());
  ++epoch_;
  ControlBlock& own = block(rank_);
  char* slot = own.operations[epoch_ % 2];
  std::snprintf(slot, kOperationBytes, "%s", operation);
  own.arrival.store(epoch_, std::memory_order_release);  // publishes the name and the record
  wake_peers();
  const auto deadline = deadline_after(timeout_);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) ODC_RETURN_IF_ERROR(wait_for_peer(peer, epoch_, operation, deadline));
  }
  return Status::Ok();
}

Status ShmBootstrap::wait_for_peer(int peer, uint64_t epoch, const char* operation,
                                   Clock::time_point deadline) {
  ControlBlock& other = block(peer);
  const std::string who = "rank " + std::to_string(peer);
  auto next_liveness_check = Clock::now();
  // 1: the peer reached this collective; 0: not yet; -1: it is in a differently named one.
  auto reached = [&](uint64_t peer_epoch) {
    if (peer_epoch > epoch) return 1;
    if (peer_epoch < epoch) return 0;
    const char* theirs = other.operations[epoch % 2];
    return strncmp(theirs, operation, kOperationBytes - 1) == 0 ? 1 : -1;
  };
  // A peer may arrive, pass the collective and exit between our reads: before reporting that it
  // failed, closed or died, look once more whether it arrived.
  auto unless_arrived = [&](Status failure) {
    return reached(other.arrival.load(std::memory_order_acquire)) == 1 ? Status::Ok() : failure;
  };
  for (int attempt = 0;; ++attempt) {
    const uint32_t seen_wake = other.wake.load(std::memory_order_acquire);
    const uint64_t peer_epoch = other.arrival.load(std::memory_order_acquire);
    const int state_of_peer = reached(peer_epoch);
    if (state_of_peer == 1) return Status::Ok();
    if (state_of_peer == -1) {
      const std::string theirs(other.operations[epoch % 2],
                               strnlen(other.operations[epoch % 2], kOperationBytes));
      return Status::RemoteError("collective mismatch: " + who + " called " + theirs +
                                 " where this rank called " + operation);
    }
    const uint32_t state = other.state.load(std::memory_order_acquire);
    const auto now = Clock::now();
    if (state == kFailed || state == kClosed || now >= next_liveness_check) {
      if (Status alive = peer_status(peer); !alive.ok()) return unless_arrived(alive);
      if (Status claim = check_claim(); !claim.ok()) return unless_arrived(claim);
      next_liveness_check = now + std::chrono::milliseconds(10);
    }
    if (now >= deadline) {
      const std::string last =
          peer_epoch == 0
              ? std::string("none")
              : std::string(other.operations[peer_epoch % 2],
                            strnlen(other.operations[peer_epoch % 2], kOperationBytes)) +
                    " #" + std::to_string(peer_epoch);
      return unless_arrived(Status::Timeout("timed out after " + timeout_text(timeout_) +
                                            " waiting for " + who + " in " + operation +
                                            " (its last collective: " + last + ")"));
    }
    if (attempt < 64) {
      std::this_thread::yield();
      continue;
    }
    if (Status interrupted = poll_interrupt("waiting for " + who + " in " + operation);
        !interrupted.ok()) {
      return unless_arrived(interrupted);
    }
    futex_wait(&other.wake, seen_wake, until(deadline, kInterruptPollInterval));
  }
}

Status ShmBootstrap::barrier(const char* operation) {
  return arrive_and_wait(operation);
}

Status ShmBootstrap::allgather(const void* mine, void* all, size_t bytes, const char* operation) {
  const auto* in = static_cast<const unsigned char*>(mine);
  auto* out = static_cast<unsigned char*>(all);
  // At least one round, so that a zero-byte allgather still meets every rank.
  for (size_t offset = 0; offset < bytes || offset == 0; offset += kRecordBytes) {
    const size_t chunk = std::min(kRecordBytes, bytes - offset);
    const size_t slot = (epoch_ + 1) % 2;  // the slot of the collective about to be entered
    if (chunk > 0) std::memcpy(block(rank_).records[slot], in + offset, chunk);
    ODC_RETURN_IF_ERROR(arrive_and_wait(operation));
    for (int r = 0; r < world_size_; ++r) {
      if (chunk > 0) {
        std::memcpy(out + static_cast<size_t>(r) * bytes + offset, block(r).records[slot], chunk);
      }
    }
    if (bytes == 0) break;
  }
  return Status::Ok();
}

std::string ShmBootstrap::failure_of(int peer) {
  if (peer < 0 || peer >= world_size_ || !controls_[static_cast<size_t>(peer)]) return "";
  const ControlBlock& other = block(peer);
  if (other.state.load(std::memory_order_acquire) != kFailed) return "";
  return ": " + std::string(other.failure, strnlen(other.failure, sizeof(other.failure)));
}

void ShmBootstrap::mark_failed(const std::string& reason) {
  if (!controls_[rank_]) return;
  ControlBlock& own = block(rank_);
  if (own.state.load(std::memory_order_acquire) == kFailed) return;
  const size_t length = std::min(reason.size(), sizeof(own.failure) - 1);
  std::memcpy(own.failure, reason.data(), length);
  own.failure[length] = '\0';
  own.state.store(kFailed, std::memory_order_release);
  wake_peers();
}

}  // namespace odc::shm
