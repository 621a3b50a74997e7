/*
 * ggml-rpc-kit interposer: makes RPC devices appear inside an unmodified upstream program.
 *
 * Upstream test-backend-ops enumerates the devices that ggml_backend_load_all() registers and has no option to add
 * an RPC server. Preloaded with LD_PRELOAD, this library's ggml_backend_load_all() runs the real one, then adds every
 * server named in GGML_RPC_KIT_SERVERS (comma-separated HOST:PORT) through upstream's public RPC API and registers
 * its devices, which then show up as RPC0, RPC1, ... like any other device.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void * reg_t;
typedef void * dev_t_;

static void kit_register_servers(void) {
    const char * list = getenv("GGML_RPC_KIT_SERVERS");
    if (list == NULL || *list == '\0') {
        return;
    }
    /* libggml-rpc is found through the program's own library path (LD_LIBRARY_PATH / RPATH). */
    reg_t (*add_server)(const char *) = (reg_t (*)(const char *)) dlsym(RTLD_DEFAULT, "ggml_backend_rpc_add_server");
    if (add_server == NULL) {
        void * lib = dlopen("libggml-rpc.so", RTLD_NOW | RTLD_GLOBAL);
        if (lib != NULL) {
            add_server = (reg_t (*)(const char *)) dlsym(lib, "ggml_backend_rpc_add_server");
        }
    }
    size_t (*dev_count)(reg_t) = (size_t (*)(reg_t)) dlsym(RTLD_DEFAULT, "ggml_backend_reg_dev_count");
    dev_t_ (*dev_get)(reg_t, size_t) = (dev_t_ (*)(reg_t, size_t)) dlsym(RTLD_DEFAULT, "ggml_backend_reg_dev_get");
    void (*dev_register)(dev_t_) = (void (*)(dev_t_)) dlsym(RTLD_DEFAULT, "ggml_backend_device_register");
    if (add_server == NULL || dev_count == NULL || dev_get == NULL || dev_register == NULL) {
        fprintf(stderr, "ggml-rpc-kit interposer: the ggml RPC or backend API was not found (%s)\n", dlerror());
        return;
    }
    char * copy = strdup(list);
    char * save = NULL;
    for (char * endpoint = strtok_r(copy, ",", &save); endpoint != NULL; endpoint = strtok_r(NULL, ",", &save)) {
        reg_t reg = add_server(endpoint);
        if (reg == NULL) {
            fprintf(stderr, "ggml-rpc-kit interposer: cannot add RPC server %s\n", endpoint);
            continue;
        }
        size_t n = dev_count(reg);
        for (size_t i = 0; i < n; i++) {
            dev_register(dev_get(reg, i));
        }
        if (getenv("GGML_RPC_KIT_VERBOSE") != NULL) {
            fprintf(stderr, "ggml-rpc-kit interposer: %zu device(s) of %s registered\n", n, endpoint);
        }
    }
    free(copy);
}

void ggml_backend_load_all(void) {
    void (*real)(void) = (void (*)(void)) dlsym(RTLD_NEXT, "ggml_backend_load_all");
    if (real != NULL) {
        real();
    }
    kit_register_servers();
}
