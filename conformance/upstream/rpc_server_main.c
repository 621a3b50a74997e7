/*
 * The kit's own RPC server program for a ggml build that has none (ggml alone, built from its source package):
 * it serves the CPU device through the RPC backend's exported server entry point, found through the backend
 * registry as ggml's own programs find it, so that one program works with backends linked in and with backends
 * loaded at run time.
 *
 *     ggml-rpc-kit-server -H 127.0.0.1 -p PORT [-t THREADS] [-c]
 *
 * The options are rpc-server's: -c keeps the hash cache in $LLAMA_CACHE/rpc. Only loopback addresses are
 * served: the kit never starts a server reachable from elsewhere.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ggml-backend.h"

/* The server entry point's type, as ggml-rpc.h declares it for protocol 8.0.0. */
typedef void (*start_server_fn)(const char *endpoint, const char *cache_dir, size_t n_threads, size_t n_devices,
                                ggml_backend_dev_t *devices);

static int usage(const char *prog) {
    fprintf(stderr, "usage: %s -H 127.0.0.1 -p PORT [-t THREADS] [-c]\n", prog);
    return 2;
}

static int make_dirs(char *path) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(path, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1";
    long port = 50052, threads = 1;
    int cache = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if ((!strcmp(a, "-H") || !strcmp(a, "--host")) && i + 1 < argc) host = argv[++i];
        else if ((!strcmp(a, "-p") || !strcmp(a, "--port")) && i + 1 < argc) port = strtol(argv[++i], NULL, 10);
        else if ((!strcmp(a, "-t") || !strcmp(a, "--threads")) && i + 1 < argc) threads = strtol(argv[++i], NULL, 10);
        else if (!strcmp(a, "-c") || !strcmp(a, "--cache")) cache = 1;
        else return usage(argv[0]);
    }
    if (strcmp(host, "127.0.0.1") != 0 && strcmp(host, "::1") != 0) {
        fprintf(stderr, "ggml-rpc-kit-server: refusing to bind %s: loopback only\n", host);
        return 2;
    }
    if (port <= 0 || port > 65535 || threads <= 0) return usage(argv[0]);

    /* A build with its backends linked in has registered them already; one that loads them at run time has not. */
    if (ggml_backend_reg_by_name("RPC") == NULL) ggml_backend_load_all();
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (rpc == NULL) {
        fprintf(stderr, "ggml-rpc-kit-server: this ggml has no RPC backend\n");
        return 1;
    }
    start_server_fn start = (start_server_fn)ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_start_server");
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (start == NULL || cpu == NULL) {
        fprintf(stderr, "ggml-rpc-kit-server: no %s\n", start == NULL ? "server entry point" : "CPU device");
        return 1;
    }

    char cache_dir[4096];
    const char *cache_arg = NULL;
    if (cache) {
        const char *base = getenv("LLAMA_CACHE");
        if (base == NULL || !*base) {
            fprintf(stderr, "ggml-rpc-kit-server: -c needs LLAMA_CACHE\n");
            return 2;
        }
        if (snprintf(cache_dir, sizeof cache_dir, "%s/rpc", base) >= (int)sizeof cache_dir || make_dirs(cache_dir)) {
            fprintf(stderr, "ggml-rpc-kit-server: cannot create %s/rpc\n", base);
            return 1;
        }
        cache_arg = cache_dir;
    }
    char endpoint[300];
    snprintf(endpoint, sizeof endpoint, "%s:%ld", host, port);
    fprintf(stderr, "ggml-rpc-kit-server: serving %s on %s, %ld thread(s), cache %s\n", ggml_backend_dev_name(cpu),
            endpoint, threads, cache_arg ? cache_arg : "none");
    start(endpoint, cache_arg, (size_t)threads, 1, &cpu);
    fprintf(stderr, "ggml-rpc-kit-server: the server stopped\n");
    return 1;
}
