/*
 * The exit-recording shim, compiled: the same shim as _shim.pl and _shim.py (engine/cron/_shell.py's
 * shim_argv says which one runs), without an interpreter's start (its command starts about 0.5 ms after
 * the spawn, against 2-5 ms for the Perl one). Built at install time into _shim.bin next to this file
 * (setup.py); where no C compiler is found nothing is built and the engine runs the Perl or Python shim.
 *
 * Run as `_shim.bin EXIT_FILE -- COMMAND [ARGS...]` as the leader of the command's process group. It runs
 * COMMAND (looked up in PATH) with default signal dispositions, waits for it, writes
 * {"pid", "exit_code" | "signal", "ended_at"} to EXIT_FILE (temp file EXIT_FILE.tmp.PID, fsync, rename,
 * fsync of the folder), then ends the way the command did: the same signal, raised again on itself, or
 * the same exit code. It ignores SIGINT, SIGTERM, SIGQUIT and SIGHUP itself (they reach the command
 * through the group; the shim must outlive the command to record it), and nothing ties it to the engine:
 * an engine that dies leaves it running, and the next engine reads the file. The record's blocks are
 * reserved before the command starts (4 KiB of spaces, overwritten in place), so a disk filled meanwhile
 * cannot lose it; when the record still cannot be written the shim says so on stderr and ends with the
 * command's own status. A command that cannot be run is recorded as {"pid": null, "exit_code": 127}.
 *
 * Plain POSIX C, no dependency: cc -O2 -Wall -Wextra -Werror -o _shim.bin _shim.c
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

enum { RESERVE_BYTES = 4096 };

static const int passed_on[] = {SIGINT, SIGTERM, SIGQUIT, SIGHUP};

static char tmp[4096];       /* EXIT_FILE.tmp.PID */
static int reserved = -1;    /* the temp file, its blocks written before the command starts */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Write all of data at offset (a short write is retried); 0, or -1 with errno set. */
static int write_all(int fd, const char *data, size_t size, off_t offset) {
    while (size > 0) {
        ssize_t n = pwrite(fd, data, size, offset);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            if (n == 0) errno = ENOSPC;
            return -1;
        }
        data += n, size -= (size_t)n, offset += n;
    }
    return 0;
}

/* The temp file, opened without following a link, given its blocks; 0, or an errno. */
static int reserve(void) {
    static char spaces[RESERVE_BYTES];
    int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return errno;
    memset(spaces, ' ', sizeof spaces);
    if (write_all(fd, spaces, sizeof spaces, 0) < 0) {
        int problem = errno;
        close(fd);
        return problem;
    }
    reserved = fd;
    return 0;
}

/* Write data as the record (into the reserved blocks, else a fresh temp file), rename it into place and
 * fsync the folder; 0, or the failure's errno. */
static int write_record(const char *exit_file, const char *data) {
    size_t size = strlen(data);
    int fd = reserved;
    reserved = -1;
    if (fd < 0) fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return errno;
    if (write_all(fd, data, size, 0) < 0 || ftruncate(fd, (off_t)size) < 0 || fsync(fd) < 0) {
        int failure = errno;
        close(fd);
        return failure;
    }
    if (close(fd) < 0 || rename(tmp, exit_file) < 0) return errno;
    char folder[sizeof tmp];
    const char *slash = strrchr(exit_file, '/');
    if (slash == NULL) {
        strcpy(folder, ".");
    } else {
        size_t length = slash == exit_file ? 1 : (size_t)(slash - exit_file);
        memcpy(folder, exit_file, length);
        folder[length] = '\0';
    }
    int dir = open(folder, O_RDONLY | O_CLOEXEC);
    if (dir >= 0) {  /* the rename made durable; a folder that cannot be opened is no failure */
        fsync(dir);
        close(dir);
    }
    return 0;
}

/* End as the command ended: the same signal, raised again on itself, or the same exit code. */
static void end_as(int status) {
    if (WIFSIGNALED(status)) {
        int number = WTERMSIG(status);
        sigset_t only;
        signal(number, SIG_DFL);  /* fails harmlessly for SIGKILL and SIGSTOP */
        sigemptyset(&only);
        sigaddset(&only, number);
        sigprocmask(SIG_UNBLOCK, &only, NULL);
        kill(getpid(), number);
        _exit(128 + number);  /* a signal that does not end a process by default */
    }
    _exit(WEXITSTATUS(status));
}

int main(int argc, char **argv) {
    if (argc < 4 || strcmp(argv[2], "--") != 0) {
        fputs("usage: _shim.bin EXIT_FILE -- COMMAND [ARGS...]\n", stderr);
        return 2;
    }
    const char *exit_file = argv[1];
    char **command = argv + 3;
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", exit_file, (long)getpid()) >= (int)sizeof tmp) {
        fprintf(stderr, "gadget-engine: the exit file's name is too long: %s\n", exit_file);
        return 2;
    }

    sigset_t defaults;  /* what the command gets with its default disposition */
    sigemptyset(&defaults);
    for (size_t i = 0; i < sizeof passed_on / sizeof passed_on[0]; i++) {
        signal(passed_on[i], SIG_IGN);
        sigaddset(&defaults, passed_on[i]);
    }
    sigaddset(&defaults, SIGPIPE);
    sigaddset(&defaults, SIGXFSZ);
    /* waitpid needs SIGCHLD not ignored (an ignored SIGCHLD reaps the command before the shim sees it). */
    signal(SIGCHLD, SIG_DFL);

    int problem = reserve();
    char record[256];
    posix_spawnattr_t attr;
    pid_t pid;
    int failed = posix_spawnattr_init(&attr);
    if (failed == 0) failed = posix_spawnattr_setsigdefault(&attr, &defaults);
    if (failed == 0) failed = posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    if (failed == 0) failed = posix_spawnp(&pid, command[0], NULL, &attr, command, environ);
    if (failed != 0) {
        fprintf(stderr, "cannot run '%s': %s\n", command[0], strerror(failed));
        snprintf(record, sizeof record, "{\"pid\": null, \"exit_code\": 127, \"ended_at\": %.6f}", now());
        write_record(exit_file, record);
        _exit(127);
    }

    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {  /* not ours to wait for after all: what the Perl shim says too */
            status = 127 << 8;
            break;
        }
    }
    if (WIFSIGNALED(status)) {
        snprintf(record, sizeof record, "{\"pid\": %ld, \"signal\": %d, \"ended_at\": %.6f}", (long)pid,
                 WTERMSIG(status), now());
    } else {
        snprintf(record, sizeof record, "{\"pid\": %ld, \"exit_code\": %d, \"ended_at\": %.6f}", (long)pid,
                 WEXITSTATUS(status), now());
    }
    int failure = write_record(exit_file, record);
    if (failure != 0) {  /* stderr is the watch log; a line that cannot be written is no reason to fail */
        char reserve_too[256] = "";
        unlink(tmp);
        if (problem != 0)
            snprintf(reserve_too, sizeof reserve_too, "; reserving its space failed too: %s", strerror(problem));
        fprintf(stderr,
                "gadget-engine: the exit of '%s' could not be recorded (%s%s); "
                "the shim ends with the command's own status instead\n",
                command[0], strerror(failure), reserve_too);
    }
    end_as(status);
    return 0;  /* not reached */
}
