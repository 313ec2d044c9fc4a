/*
 * One spawn, straight into the child's cgroup: clone3(CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP), the
 * file actions, the working directory and execve, in one call from Python (engine/_spawn.py loads this
 * library with ctypes). Built at install time into _spawn_direct.bin next to this file (setup.py); where it
 * is not built, or the kernel lacks clone3 (5.3), CLONE_INTO_CGROUP (5.7) or close_range (5.9), the engine
 * spawns through glibc's posix_spawn and moves itself into the leaf and back, as before.
 *
 * What the child gets is what engine/_spawn.py's posix_spawn path gives it: a new session; every signal
 * 1-31 but SIGKILL and SIGSTOP at its default disposition (and any other signal that has a handler); an
 * empty signal mask; stdin, stdout and stderr as asked (a descriptor, or /dev/null); no other descriptor;
 * the working directory; exactly the environment given. An error of any step before the program runs
 * (chdir, execve, ...) is returned as its error number, and the child is reaped: never a child that
 * "exited 127".
 *
 * The child shares the parent's memory until its execve (that is what makes vfork cheap: no page tables
 * copied), so it runs on a stack of its own, carved from the calling frame (the parent is suspended until
 * the child has exec'd or exited), and it never returns through a frame of the parent: the clone3 call is
 * a few lines of assembly that, in the child, call child_main on the new stack and exit with what it
 * returns (glibc's own clone does the same). Every signal is blocked around the clone, and the child
 * resets every handler before it unblocks them: no handler of the parent can run on the shared memory.
 * x86-64 only; elsewhere gadget_spawn says ENOSYS and the posix_spawn path is used.
 *
 * cc -O2 -Wall -Wextra -Werror -shared -fPIC -o _spawn_direct.bin _spawn_direct.c
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef CLONE_VM
#define CLONE_VM 0x00000100
#endif
#ifndef CLONE_VFORK
#define CLONE_VFORK 0x00004000
#endif
#define GADGET_CLONE_INTO_CGROUP 0x200000000ULL

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

/* The kernel's struct clone_args, up to the cgroup field (CLONE_ARGS_SIZE_VER2). */
struct gadget_clone_args {
    uint64_t flags;
    uint64_t pidfd;
    uint64_t child_tid;
    uint64_t parent_tid;
    uint64_t exit_signal;
    uint64_t stack;
    uint64_t stack_size;
    uint64_t tls;
    uint64_t set_tid;
    uint64_t set_tid_size;
    uint64_t cgroup;
};

/* The kernel's sigaction on x86-64 (handler, flags, restorer, mask), and its 64-signal set. */
struct gadget_ksigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

enum { CHILD_STACK_BYTES = 32 * 1024, KERNEL_NSIG = 64 };  /* the child calls a few syscall wrappers only */

struct child_args {
    const char *path;
    char *const *argv;
    char *const *envp;
    const char *cwd;
    int fds[3];             /* the child's 0, 1, 2: a descriptor, or -1 for /dev/null */
    volatile int err;       /* written by the child when a step fails (shared memory until execve) */
    volatile int unsupported; /* the step failed because the kernel lacks it (close_range) */
    volatile int ran;       /* set by the child first: 0 after the clone means it never ran (below) */
};

#if defined(__x86_64__)
/*
 * long gadget_clone3(struct gadget_clone_args *args, size_t size, int (*fn)(void *), void *arg)
 *
 * The parent gets the child's pid or -errno. The child starts on args->stack with the parent's registers
 * but rax; r8 and r9 (kept by the syscall) carry fn and arg; it calls fn(arg) and exits with its value.
 */
__asm__(
    ".pushsection .text\n"
    ".p2align 4\n"
    ".type gadget_clone3, @function\n"
    "gadget_clone3:\n"
    "    mov %rdx, %r8\n"
    "    mov %rcx, %r9\n"
    "    mov $435, %eax\n"
    "    syscall\n"
    "    test %rax, %rax\n"
    "    jnz 1f\n"
    "    xor %ebp, %ebp\n"
    "    mov %r9, %rdi\n"
    "    call *%r8\n"
    "    mov %eax, %edi\n"
    "    mov $60, %eax\n"
    "    syscall\n"
    "    hlt\n"
    "1:  ret\n"
    ".size gadget_clone3, .-gadget_clone3\n"
    ".popsection\n");
long gadget_clone3(struct gadget_clone_args *args, size_t size, int (*fn)(void *), void *arg);
#define HAVE_GADGET_CLONE3 1
#endif

static long raw(long nr, long a, long b, long c, long d) {
    return syscall(nr, a, b, c, d);  /* errno is the parent's thread's: it is suspended, and ignores it */
}

static int fail(struct child_args *a, int err) {
    a->err = err ? err : EINVAL;
    return 127;
}

/* In the child, on its own stack, sharing the parent's memory: make the slate, then execve. */
static int child_main(void *arg) {
    struct child_args *a = arg;
    a->ran = 1;
    struct gadget_ksigaction dfl = {0}, cur;
    dfl.handler = SIG_DFL;
    for (int sig = 1; sig <= KERNEL_NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        if (sig >= 32) {  /* kept ignored when ignored, as posix_spawn does outside its default set */
            if (raw(SYS_rt_sigaction, sig, 0, (long)&cur, 8) != 0) continue;
            if (cur.handler == SIG_IGN || cur.handler == SIG_DFL) continue;
        }
        raw(SYS_rt_sigaction, sig, (long)&dfl, 0, 8);
    }
    if (raw(SYS_setsid, 0, 0, 0, 0) < 0) return fail(a, errno);
    int fds[3] = {a->fds[0], a->fds[1], a->fds[2]};
    for (int i = 0; i < 3; i++) {  /* a source among 0-2 that is not its own target: moved out of the way */
        if (fds[i] >= 0 && fds[i] < 3 && fds[i] != i) {
            fds[i] = (int)raw(SYS_fcntl, fds[i], F_DUPFD_CLOEXEC, 3, 0);
            if (fds[i] < 0) return fail(a, errno);
        }
    }
    for (int i = 0; i < 3; i++) {
        if (fds[i] < 0) {
            int fd = (int)raw(SYS_openat, AT_FDCWD, (long)"/dev/null", i == 0 ? O_RDONLY : O_WRONLY, 0);
            if (fd < 0) return fail(a, errno);
            if (fd != i) {
                if (raw(SYS_dup2, fd, i, 0, 0) < 0) return fail(a, errno);
                raw(SYS_close, fd, 0, 0, 0);
            }
        } else if (fds[i] == i) {
            if (raw(SYS_fcntl, i, F_SETFD, 0, 0) < 0) return fail(a, errno);
        } else if (raw(SYS_dup2, fds[i], i, 0, 0) < 0) {
            return fail(a, errno);
        }
    }
    if (raw(SYS_close_range, 3, ~0U, 0, 0) < 0) {
        if (errno == ENOSYS) a->unsupported = 1;
        return fail(a, errno);
    }
    if (raw(SYS_chdir, (long)a->cwd, 0, 0, 0) < 0) return fail(a, errno);
    uint64_t empty = 0;
    raw(SYS_rt_sigprocmask, SIG_SETMASK, (long)&empty, 0, 8);
    raw(SYS_execve, (long)a->path, (long)a->argv, (long)a->envp, 0);
    return fail(a, errno);
}

/* The version of gadget_spawn's arguments: engine/_spawn_direct.py loads no library of another (a library
 * left from an older build would be called with arguments it does not take). */
int gadget_spawn_abi(void) { return 3; }

/* CLOCK_BOOTTIME in ns: the clock the kernel stamps a new process's start with (in copy_process). */
static int64_t boottime(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_BOOTTIME, &ts) != 0) return -1;
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Pointers to the n NUL-terminated strings laid end to end in blob, and a NULL; NULL when out of memory. */
static char **split(const char *blob, int n) {
    char **out = malloc(((size_t)n + 1) * sizeof(char *));
    if (out == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        out[i] = (char *)blob;
        blob += strlen(blob) + 1;
    }
    out[n] = NULL;
    return out;
}

/*
 * Start path with argv (argc strings laid end to end, each ending in NUL) and envp (envc such strings),
 * in cwd, with stdin_fd, stdout_fd and stderr_fd (-1: /dev/null), born in the cgroup of the directory
 * descriptor cgroup_fd (-1: the caller's cgroup).
 *
 * Returns 0 and the pid in *pid_out; boottime_ns[0] and [1] are CLOCK_BOOTTIME read right before and right
 * after the clone, so the child's start (its start_boottime) lies between them. Else a positive error number when a step in the child failed (the child
 * is reaped; nothing is left); a negative one when no child was made: -ENOSYS, -E2BIG or -EINVAL when
 * the kernel lacks what this needs (the caller falls back), -ECANCELED when the child was killed before
 * it ran a single instruction (reaped: the kernel kills every process cloned into a cgroup whose
 * cgroup.kill was written since that cgroup was made, as Linux 6.18 does), else the clone's error.
 */
int gadget_spawn(const char *path, const char *argv_blob, int argc, const char *env_blob, int envc,
                 const char *cwd, int stdin_fd, int stdout_fd, int stderr_fd, int cgroup_fd, int *pid_out,
                 int64_t *boottime_ns) {
#if !defined(HAVE_GADGET_CLONE3)
    (void)path, (void)argv_blob, (void)argc, (void)env_blob, (void)envc, (void)cwd;
    (void)stdin_fd, (void)stdout_fd, (void)stderr_fd, (void)cgroup_fd, (void)pid_out, (void)boottime_ns;
    return -ENOSYS;
#else
    _Alignas(16) char stack[CHILD_STACK_BYTES];
    struct child_args a = {
        .path = path, .cwd = cwd, .fds = {stdin_fd, stdout_fd, stderr_fd}, .err = 0, .unsupported = 0,
        .ran = 0};
    char **argv = split(argv_blob, argc);
    char **envp = split(env_blob, envc);
    if (argv == NULL || envp == NULL) {
        free(argv);
        free(envp);
        return -ENOMEM;
    }
    a.argv = argv;
    a.envp = envp;
    struct gadget_clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = CLONE_VM | CLONE_VFORK;
    args.exit_signal = SIGCHLD;
    args.stack = (uint64_t)(uintptr_t)stack;
    args.stack_size = sizeof stack;
    if (cgroup_fd >= 0) {
        args.flags |= GADGET_CLONE_INTO_CGROUP;
        args.cgroup = (uint64_t)cgroup_fd;
    }
    uint64_t all = ~(uint64_t)0, old = 0;
    int saved_errno = errno;
    raw(SYS_rt_sigprocmask, SIG_SETMASK, (long)&all, (long)&old, 8);
    boottime_ns[0] = boottime();
    long pid = gadget_clone3(&args, sizeof args, child_main, &a);
    boottime_ns[1] = boottime();
    raw(SYS_rt_sigprocmask, SIG_SETMASK, (long)&old, 0, 8);
    free(argv);
    free(envp);
    int result;
    if (pid < 0) {
        result = (int)pid;
    } else if (a.err != 0 || !a.ran) {
        while (waitpid((pid_t)pid, NULL, 0) < 0 && errno == EINTR) {
        }
        result = !a.ran ? -ECANCELED : a.unsupported ? -ENOSYS : a.err;
    } else {
        *pid_out = (int)pid;
        result = 0;
    }
    errno = saved_errno;
    return result;
#endif
}
