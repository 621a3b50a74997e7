/*
 * ggml-rpc-kit fork server: a spawned server's death costs a fork, not a process start.
 *
 * Preloaded (LD_PRELOAD) into a server the kit starts with GGML_RPC_KIT_FORK_SERVER=TOKEN:FD in its environment.
 * The first time the process calls accept() it has done all of its initialisation (backends started, socket bound
 * and listening). There it becomes the *supervisor*: that call never returns in it. It forks a child, which returns
 * into the accept() and goes on as the server, accept loop and all, and waits for the child to end. When it does
 * (a death), the supervisor reports the child's wait status, stops listening (a new connection is refused, as it is
 * by a dead process) and waits for the kit's word on FD ('r') to listen again and fork a fresh child: the server as
 * it was when it first reached accept(), for the price of a fork.
 *
 * The supervisor reports on stderr, which the kit reads together with stdout, so that a report follows everything
 * the child wrote before it ended (the child's output between its own "child" line and the supervisor's "end" line
 * is the child's). Lines, each written with one write():
 *     ggml-rpc-kit-fork-server TOKEN ready PID            the supervisor is waiting; its children follow
 *     ggml-rpc-kit-fork-server TOKEN threads N            not a supervisor: the process has N threads at accept()
 *                                                         (fork copies only the calling one), accept() passes through
 *     ggml-rpc-kit-fork-server TOKEN child N PID          written by child N before it serves
 *     ggml-rpc-kit-fork-server TOKEN end N PID STATUS     child N ended; STATUS is waitpid()'s status word
 *     ggml-rpc-kit-fork-server TOKEN failed WHAT ERRNO    the supervisor cannot go on (it exits with status 70)
 * Without the variable, or in any process but the first to accept, every call passes through unchanged.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define KIT_ENV "GGML_RPC_KIT_FORK_SERVER"
#define KIT_MARK "ggml-rpc-kit-fork-server"
/* The supervisor's exit status when it cannot go on (EX_SOFTWARE): the kit then starts the server anew. */
#define KIT_FAILED 70

typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*accept4_fn)(int, struct sockaddr *, socklen_t *, int);
typedef int (*listen_fn)(int, int);

/* 0: not decided yet; 1: pass through (no fork server, or a child); the supervisor never returns to the caller. */
static int kit_decided;
static char kit_token[64];
static int kit_control = -1;
/* The backlog each listening socket was given (re-listening after a death uses the server's own). */
#define KIT_MAX_FD 1024
static int kit_backlog[KIT_MAX_FD];

static void kit_say(const char * fmt, ...) {
    char line[256];
    int n = snprintf(line, sizeof line, KIT_MARK " %s ", kit_token);
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t) n - 1, fmt, ap);
    va_end(ap);
    if (n > (int) sizeof line - 2) {
        n = (int) sizeof line - 2;
    }
    line[n++] = '\n';
    /* One write: a line shorter than PIPE_BUF reaches the kit whole, never interleaved with the server's output. */
    const char * p = line;
    while (n > 0) {
        ssize_t w = write(STDERR_FILENO, p, (size_t) n);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            return;
        }
        p += w;
        n -= (int) w;
    }
}

static int kit_threads(void) {
    DIR * dir = opendir("/proc/self/task");
    if (dir == NULL) {
        return -1;
    }
    int n = 0;
    for (struct dirent * e = readdir(dir); e != NULL; e = readdir(dir)) {
        if (e->d_name[0] != '.') {
            n++;
        }
    }
    closedir(dir);
    return n;
}

/* Parse GGML_RPC_KIT_FORK_SERVER=TOKEN:FD; 0 when absent or malformed. */
static int kit_configure(void) {
    const char * value = getenv(KIT_ENV);
    if (value == NULL) {
        return 0;
    }
    const char * colon = strrchr(value, ':');
    if (colon == NULL || colon == value || (size_t) (colon - value) >= sizeof kit_token) {
        return 0;
    }
    memcpy(kit_token, value, (size_t) (colon - value));
    kit_token[colon - value] = '\0';
    kit_control = atoi(colon + 1);
    /* Whatever the server starts later (a helper program) is no fork server of its own. */
    unsetenv(KIT_ENV);
    return kit_control > 2;
}

static void kit_fail(const char * what) {
    kit_say("failed %s %d", what, errno);
    _exit(KIT_FAILED);
}

/* Listen again on the same address after a death (shutdown() left the socket bound but closed). */
static void kit_relisten(int fd, const struct sockaddr_storage * addr, socklen_t addr_len) {
    int backlog = fd < KIT_MAX_FD && kit_backlog[fd] > 0 ? kit_backlog[fd] : SOMAXCONN;
    listen_fn real_listen = (listen_fn) dlsym(RTLD_NEXT, "listen");
    struct sockaddr_storage now;
    socklen_t now_len = sizeof now;
    if (real_listen(fd, backlog) == 0 && getsockname(fd, (struct sockaddr *) &now, &now_len) == 0 &&
        now_len == addr_len && memcmp(&now, addr, addr_len) == 0) {
        return;
    }
    /* The port went with the shutdown (a socket bound to port 0): a new socket bound where the old one was, in
     * the same descriptor. */
    int type = SOCK_STREAM;
    socklen_t type_len = sizeof type;
    getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len);
    int fresh = socket(addr->ss_family, type, 0);
    int one = 1;
    if (fresh < 0 || setsockopt(fresh, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(fresh, (const struct sockaddr *) addr, addr_len) != 0 || real_listen(fresh, backlog) != 0 ||
        dup2(fresh, fd) < 0) {
        kit_fail("listen");
    }
    close(fresh);
}

/* The supervisor's loop; returns only in a child, which then accepts as the server would have. */
static void kit_supervise(int fd) {
    struct sockaddr_storage addr;
    socklen_t addr_len = sizeof addr;
    if (getsockname(fd, (struct sockaddr *) &addr, &addr_len) != 0) {
        kit_fail("getsockname");
    }
    /* The server may ignore SIGCHLD (children reaped by the kernel): the supervisor needs the status. */
    struct sigaction old_chld, dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &dfl, &old_chld);
    kit_say("ready %d", (int) getpid());
    for (unsigned long n = 1;; n++) {
        /* Output the server buffered before the fork is written once, not once per child. */
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
            kit_fail("fork");
        }
        if (pid == 0) {
            sigaction(SIGCHLD, &old_chld, NULL);
            /* The child goes with the supervisor (a kit that stops it kills the process group anyway). */
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            close(kit_control);
            kit_say("child %lu %d", n, (int) getpid());
            return;
        }
        int status = 0;
        while (waitpid(pid, &status, 0) < 0) {
            if (errno != EINTR) {
                kit_fail("waitpid");
            }
        }
        /* Refused first, reported then, as with a process that dies: its listening socket is closed before
         * anyone can see its exit status. */
        shutdown(fd, SHUT_RDWR);
        kit_say("end %lu %d %d", n, (int) pid, status);
        char word = 0;
        for (;;) {
            ssize_t r = read(kit_control, &word, 1);
            if (r == 1 && word == 'r') {
                break;
            }
            if (r == 0 || (r < 0 && errno != EINTR)) {
                _exit(0); /* the kit is gone or closed its end: nothing more to serve */
            }
        }
        kit_relisten(fd, &addr, addr_len);
    }
}

static void kit_enter(int fd) {
    if (kit_decided) {
        return;
    }
    kit_decided = 1;
    if (!kit_configure()) {
        return;
    }
    int threads = kit_threads();
    if (threads != 1) {
        /* A copy of this process would lack the other threads (a worker pool waited on would never answer). */
        kit_say("threads %d", threads);
        return;
    }
    kit_supervise(fd);
}

int listen(int fd, int backlog) {
    listen_fn real = (listen_fn) dlsym(RTLD_NEXT, "listen");
    if (fd >= 0 && fd < KIT_MAX_FD) {
        kit_backlog[fd] = backlog;
    }
    return real(fd, backlog);
}

int accept(int fd, struct sockaddr * addr, socklen_t * addr_len) {
    accept_fn real = (accept_fn) dlsym(RTLD_NEXT, "accept");
    kit_enter(fd);
    return real(fd, addr, addr_len);
}

int accept4(int fd, struct sockaddr * addr, socklen_t * addr_len, int flags) {
    accept4_fn real = (accept4_fn) dlsym(RTLD_NEXT, "accept4");
    kit_enter(fd);
    return real(fd, addr, addr_len, flags);
}
