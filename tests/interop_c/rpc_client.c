/*
 * A ggml RPC client written from spec/PROTOCOL.md alone: no code of the kit, no upstream source.
 *
 * It computes c = a + b on a server, the way PROTOCOL.md#compute and PROTOCOL.md#compute-example describe, and
 * checks the numbers:
 *   HELLO, GET_ALIGNMENT, ALLOC_BUFFER, BUFFER_GET_BASE, SET_TENSOR of a, b and c (c gets a sentinel),
 *   GRAPH_COMPUTE of the ADD node WITHOUT the COMPUTE flag -> GET_TENSOR of c must still hold the sentinel,
 *   GRAPH_COMPUTE of the ADD node WITH the COMPUTE flag    -> GET_TENSOR of c must hold the 8 sums,
 *   SET_TENSOR of new a, GRAPH_RECOMPUTE                   -> GET_TENSOR of c must hold the new sums,
 *   FREE_BUFFER, then GET_ALIGNMENT to learn that it was accepted (PROTOCOL.md#failures).
 *
 * usage: rpc_client HOST PORT MAJOR      (MAJOR: 6, 7 or 8, the protocol version to speak)
 * exit status: 0 all numbers right, 1 a wrong number or version, 2 a transport or protocol failure.
 *
 * Every number below is a #define that quotes the PROTOCOL.md sentence or table row it comes from, as
 * `PROTOCOL.md#anchor "quoted text"`; tests/interop_c/test_interop_c_client.py checks each quote against
 * PROTOCOL.md. The few values that are this client's own choices say so.
 */
#define _POSIX_C_SOURCE 200112L

#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

/* ---- framing: PROTOCOL.md#framing ---- */
#define REQUEST_HEADER 9   /* PROTOCOL.md#framing "**Request** (9-byte header)" */
#define REPLY_HEADER 8     /* PROTOCOL.md#framing "**Reply** (8-byte header)" */
#define U64_SIZE 8         /* PROTOCOL.md#framing "| 1 | 8 | u64 | `payload_size` |" */
#define U32_SIZE 4         /* PROTOCOL.md#v6-get_alignment "| 0 | 4 | u32 | `device` |" */
#define BYTE_BITS 8        /* PROTOCOL.md#framing "| 0 | 8 | u64 | `payload_size` |" */

/* ---- command ids, identical for these commands in 6.0.0, 7.0.0 and 8.0.0: PROTOCOL.md#enum-commands ---- */
#define CMD_ALLOC_BUFFER 0     /* PROTOCOL.md#enum-commands "| ALLOC_BUFFER | 0: [12 / reply 16](#v6-alloc_buffer)" */
#define CMD_GET_ALIGNMENT 1    /* PROTOCOL.md#enum-commands "| GET_ALIGNMENT | 1: [4 / reply 8](#v6-get_alignment)" */
#define CMD_BUFFER_GET_BASE 3  /* PROTOCOL.md#enum-commands "| BUFFER_GET_BASE | 3: [8 / reply 8](#v6-buffer_get_base)" */
#define CMD_FREE_BUFFER 4      /* PROTOCOL.md#enum-commands "| FREE_BUFFER | 4: [8 / no reply](#v6-free_buffer)" */
#define CMD_SET_TENSOR 6       /* PROTOCOL.md#enum-commands "| SET_TENSOR | 6: [304 + n / no reply](#v6-set_tensor)" */
#define CMD_GET_TENSOR 8       /* PROTOCOL.md#enum-commands "| GET_TENSOR | 8: [312 / reply request.size bytes]" */
#define CMD_GRAPH_COMPUTE 10   /* PROTOCOL.md#enum-commands "| GRAPH_COMPUTE | 10: [12 + 8·n_nodes + 296·n_tensors" */
#define CMD_HELLO 14           /* PROTOCOL.md#enum-commands "| HELLO | 14: [24 / reply 28](#v6-hello)" */
#define CMD_GRAPH_RECOMPUTE 16 /* PROTOCOL.md#enum-commands "| GRAPH_RECOMPUTE | 16: [4 / no reply](#v6-graph_recompute)" */

/* ---- payload sizes and field offsets ---- */
#define HELLO_REQ 24          /* PROTOCOL.md#hello-caps "sends 24 zero bytes" */
#define HELLO_REPLY 28        /* PROTOCOL.md#v6-hello "fixed, exactly 28 bytes" */
#define HELLO_MAJOR 0         /* PROTOCOL.md#v6-hello "| 0 | 1 | u8 | `major` |" */
#define HELLO_MINOR 1         /* PROTOCOL.md#v6-hello "| 1 | 1 | u8 | `minor` |" */
#define HELLO_PATCH 2         /* PROTOCOL.md#v6-hello "| 2 | 1 | u8 | `patch` |" */
#define ALIGNMENT_REQ 4       /* PROTOCOL.md#v6-get_alignment "fixed, exactly 4 bytes" */
#define ALIGNMENT_REPLY 8     /* PROTOCOL.md#v6-get_alignment "| 0 | 8 | u64 | `alignment` |" */
#define ALLOC_REQ 12          /* PROTOCOL.md#v6-alloc_buffer "fixed, exactly 12 bytes" */
#define ALLOC_REQ_SIZE 4      /* PROTOCOL.md#v6-alloc_buffer "| 4 | 8 | u64 | `size` | bytes requested |" */
#define ALLOC_REPLY 16        /* PROTOCOL.md#v6-alloc_buffer "fixed, exactly 16 bytes" */
#define ALLOC_REPLY_PTR 0     /* PROTOCOL.md#v6-alloc_buffer "| 0 | 8 | u64 | `remote_ptr` |" */
#define BASE_REQ 8            /* PROTOCOL.md#v6-buffer_get_base "| 0 | 8 | u64 | `remote_ptr` |" */
#define BASE_REPLY 8          /* PROTOCOL.md#v6-buffer_get_base "| 0 | 8 | u64 | `base_ptr` |" */
#define FREE_REQ 8            /* PROTOCOL.md#v6-free_buffer "| 0 | 8 | u64 | `remote_ptr` |" */
#define SET_OFFSET_V6 296     /* PROTOCOL.md#v6-set_tensor "| 296 | 8 | u64 | `offset` |" */
#define SET_HEADER_V6 304     /* PROTOCOL.md#v6-set_tensor "variable, 304-byte header + n data bytes" */
#define SET_CACHE_FLAG_V7 296 /* PROTOCOL.md#v7-set_tensor "| 296 | 1 | u8 | `cache_flag` |" */
#define SET_OFFSET_V7 297     /* PROTOCOL.md#v7-set_tensor "| 297 | 8 | u64 | `offset` |" */
#define SET_HEADER_V7 305     /* PROTOCOL.md#v7-set_tensor "variable, 305-byte header + n data bytes" */
#define GET_REQ 312           /* PROTOCOL.md#v6-get_tensor "fixed, exactly 312 bytes" */
#define GET_OFFSET 296        /* PROTOCOL.md#v6-get_tensor "| 296 | 8 | u64 | `offset` |" */
#define GET_SIZE 304          /* PROTOCOL.md#v6-get_tensor "| 304 | 8 | u64 | `size` | bytes to read |" */
#define GRAPH_N_NODES_V6 4    /* PROTOCOL.md#v6-graph_compute "| 4 | 4 | u32 | `n_nodes` |" */
#define GRAPH_NODES_V6 8      /* PROTOCOL.md#v6-graph_compute "| 8 | 8·n_nodes | u64[n_nodes] | `nodes` |" */
#define GRAPH_UID_V8 4        /* PROTOCOL.md#v8-graph_compute "| 4 | 8 | u64 | `uid` |" */
#define GRAPH_N_NODES_V8 12   /* PROTOCOL.md#v8-graph_compute "| 12 | 4 | u32 | `n_nodes` |" */
#define GRAPH_NODES_V8 16     /* PROTOCOL.md#v8-graph_compute "| 16 | 8·n_nodes | u64[n_nodes] | `nodes` |" */
#define NODE_ID_SIZE 8        /* PROTOCOL.md#v6-graph_compute "| 8·n_nodes | u64[n_nodes] | `nodes` |" */
#define RECOMPUTE_REQ_V6 4    /* PROTOCOL.md#v6-graph_recompute "fixed, exactly 4 bytes" */
#define RECOMPUTE_REQ_V8 12   /* PROTOCOL.md#v8-graph_recompute "fixed, exactly 12 bytes" */
#define RECOMPUTE_UID_V8 4    /* PROTOCOL.md#v8-graph_recompute "| 4 | 8 | u64 | `uid` |" */

/* ---- rpc_tensor: PROTOCOL.md#rpc_tensor ---- */
#define TENSOR_SIZE 296    /* PROTOCOL.md#rpc_tensor "## rpc_tensor (296 bytes)" */
#define T_ID 0             /* PROTOCOL.md#rpc_tensor "| 0 | 8 | u64 | `id` |" */
#define T_TYPE 8           /* PROTOCOL.md#rpc_tensor "| 8 | 4 | u32 | `type` |" */
#define T_BUFFER 12        /* PROTOCOL.md#rpc_tensor "| 12 | 8 | u64 | `buffer` |" */
#define T_NE 20            /* PROTOCOL.md#rpc_tensor "| 20 | 16 | u32[4] | `ne` |" */
#define T_NB 36            /* PROTOCOL.md#rpc_tensor "| 36 | 16 | u32[4] | `nb` |" */
#define T_OP 52            /* PROTOCOL.md#rpc_tensor "| 52 | 4 | u32 | `op` |" */
#define T_FLAGS 120        /* PROTOCOL.md#rpc_tensor "| 120 | 4 | i32 | `flags` |" */
#define T_SRC 124          /* PROTOCOL.md#rpc_tensor "| 124 | 80 | u64[10] | `src` |" */
#define T_DATA 220         /* PROTOCOL.md#rpc_tensor "| 220 | 8 | u64 | `data` |" */
#define DIMS 4             /* PROTOCOL.md#tensor-shape "A tensor has 4 dimensions." */
#define UNUSED_NE 1        /* PROTOCOL.md#tensor-shape "sets every unused `ne` to **1**, never 0" */

/* ---- versions ---- */
#define MAJOR_V6 6         /* PROTOCOL.md#v6 "## Protocol 6.0.0" */
#define MAJOR_V7 7         /* PROTOCOL.md#v7 "## Protocol 7.0.0" */
#define MAJOR_V8 8         /* PROTOCOL.md#v8 "## Protocol 8.0.0" */

/* ---- ggml numbers: PROTOCOL.md#enum-types, #enum-ops, #enum-flags ---- */
#define TYPE_F32 0         /* PROTOCOL.md#enum-types "| 0 | F32 | 1 | 4 |" */
#define F32_SIZE 4         /* PROTOCOL.md#enum-types "| 0 | F32 | 1 | 4 |" */
#define OP_ADD 2           /* PROTOCOL.md#enum-ops "| 2 | ADD |" */
#define FLAG_COMPUTE 16    /* PROTOCOL.md#enum-flags "| 16 | COMPUTE |" */

/* ---- the graph of PROTOCOL.md#compute-example: c = a + b, two 4 x 2 F32 matrices ---- */
#define NE0 4              /* PROTOCOL.md#compute-example "| a | 1 | F32 (0) | `{4, 2, 1, 1}`" */
#define NE1 2              /* PROTOCOL.md#compute-example "| a | 1 | F32 (0) | `{4, 2, 1, 1}`" */
#define ID_A 1             /* PROTOCOL.md#compute-example "| a | 1 | F32 (0)" */
#define ID_B 2             /* PROTOCOL.md#compute-example "| b | 2 | F32 (0)" */
#define ID_C 3             /* PROTOCOL.md#compute-example "| c | 3 | F32 (0)" */
#define N_TENSORS 3        /* PROTOCOL.md#compute-example "the three tensors (`n_tensors` 3, any order)" */
#define UID_PLAIN 1        /* choice: the 8.0.0 graph uid of the graph without COMPUTE (any non-zero) */
#define UID_ADD 2          /* choice: the 8.0.0 graph uid of the graph with COMPUTE (another one) */
#define SENTINEL (-3.25f)  /* choice: what c holds before a graph computes it */
#define B_SCALE 10         /* choice: b[i] = B_SCALE * (i + 1), a[i] = i + 1, so every sum is exact */
#define N_ARGS 4           /* choice: the program, HOST, PORT, MAJOR */
#define ARG_HOST 1         /* choice: argv[1] */
#define ARG_PORT 2         /* choice: argv[2] */
#define ARG_MAJOR 3        /* choice: argv[3] */
#define EXIT_WRONG 1       /* choice: a wrong number or version */
#define EXIT_FAILURE_RPC 2 /* choice: a transport or protocol failure */

#define NELEM (NE0 * NE1)
#define NBYTES (F32_SIZE * NELEM) /* PROTOCOL.md#nbytes: contiguous, ne[0] * ne[1] * ne[2] * ne[3] * size / blck */

static int major_version;

static void fail(int status, const char *what) {
    fprintf(stderr, "rpc_client: %s\n", what);
    exit(status);
}

/* Little-endian stores and loads (PROTOCOL.md#framing: "All integers are little-endian"). */
static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) {
        p[i] = (uint8_t)(v >> (BYTE_BITS * i));
    }
}

static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) {
        v = (v << BYTE_BITS) | p[i];
    }
    return v;
}

static void put_f32(uint8_t *p, float f) {
    uint32_t bits;
    memcpy(&bits, &f, F32_SIZE);
    put_le(p, bits, F32_SIZE);
}

static float get_f32(const uint8_t *p) {
    uint32_t bits = (uint32_t)get_le(p, F32_SIZE);
    float f;
    memcpy(&f, &bits, F32_SIZE);
    return f;
}

/* ---- the connection ---- */
static int sock = -1;

static void send_all(const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t k = send(sock, p, n, 0);
        if (k <= 0) {
            fail(EXIT_FAILURE_RPC, "send failed: the server closed the connection");
        }
        p += k;
        n -= (size_t)k;
    }
}

static void recv_all(uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t k = recv(sock, p, n, 0);
        if (k <= 0) {
            /* PROTOCOL.md#failures: a refusal shows as end-of-stream where a reply was due. */
            fail(EXIT_FAILURE_RPC, "the connection ended where a reply was due: the server refused a request");
        }
        p += k;
        n -= (size_t)k;
    }
}

/* One request: cmd byte, payload_size, payload (PROTOCOL.md#framing). */
static void request(int cmd, const uint8_t *payload, size_t size) {
    uint8_t header[REQUEST_HEADER];
    header[0] = (uint8_t)cmd;
    put_le(header + 1, size, U64_SIZE);
    send_all(header, REQUEST_HEADER);
    send_all(payload, size);
}

/* One reply: payload_size, which must be what the command's reply layout says, then the payload. */
static void reply(uint8_t *payload, size_t expected) {
    uint8_t header[REPLY_HEADER];
    recv_all(header, REPLY_HEADER);
    if (get_le(header, U64_SIZE) != expected) {
        fail(EXIT_FAILURE_RPC, "a reply's payload_size is not the command's reply size");
    }
    recv_all(payload, expected);
}

static void connect_to(const char *host, const char *port) {
    struct addrinfo hints, *res;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &res) != 0) {
        fail(EXIT_FAILURE_RPC, "cannot resolve the server's address");
    }
    sock = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    if (sock < 0 || connect(sock, res->ai_addr, res->ai_addrlen) != 0) {
        fail(EXIT_FAILURE_RPC, "cannot connect to the server");
    }
    freeaddrinfo(res);
}

/* ---- commands ---- */

/* PROTOCOL.md#hello-caps: 24 zero caps bytes over plain TCP; the version check is the client's. */
static void hello(void) {
    uint8_t caps[HELLO_REQ], out[HELLO_REPLY];
    memset(caps, 0, HELLO_REQ);
    request(CMD_HELLO, caps, HELLO_REQ);
    reply(out, HELLO_REPLY);
    printf("hello %d.%d.%d\n", out[HELLO_MAJOR], out[HELLO_MINOR], out[HELLO_PATCH]);
    if (out[HELLO_MAJOR] != major_version) {
        fail(EXIT_WRONG, "the server speaks another major version");
    }
}

static uint64_t get_alignment(void) {
    uint8_t req[ALIGNMENT_REQ], out[ALIGNMENT_REPLY];
    put_le(req, 0, U32_SIZE); /* device 0 */
    request(CMD_GET_ALIGNMENT, req, ALIGNMENT_REQ);
    reply(out, ALIGNMENT_REPLY);
    return get_le(out, U64_SIZE);
}

static uint64_t alloc_buffer(uint64_t size) {
    uint8_t req[ALLOC_REQ], out[ALLOC_REPLY];
    put_le(req, 0, U32_SIZE); /* device 0 */
    put_le(req + ALLOC_REQ_SIZE, size, U64_SIZE);
    request(CMD_ALLOC_BUFFER, req, ALLOC_REQ);
    reply(out, ALLOC_REPLY);
    return get_le(out + ALLOC_REPLY_PTR, U64_SIZE);
}

static uint64_t buffer_get_base(uint64_t remote_ptr) {
    uint8_t req[BASE_REQ], out[BASE_REPLY];
    put_le(req, remote_ptr, U64_SIZE);
    request(CMD_BUFFER_GET_BASE, req, BASE_REQ);
    reply(out, BASE_REPLY);
    return get_le(out, U64_SIZE);
}

/* A contiguous F32 tensor of NE0 x NE1 (PROTOCOL.md#tensor-shape): nb[0] = size, nb[i] = nb[i-1] * ne[i-1]. */
static void tensor(uint8_t *t, uint64_t id, uint64_t buffer, uint64_t data) {
    uint64_t ne[DIMS] = {NE0, NE1, UNUSED_NE, UNUSED_NE};
    memset(t, 0, TENSOR_SIZE);
    put_le(t + T_ID, id, U64_SIZE);
    put_le(t + T_TYPE, TYPE_F32, U32_SIZE);
    put_le(t + T_BUFFER, buffer, U64_SIZE);
    uint64_t nb = F32_SIZE;
    for (int i = 0; i < DIMS; i++) {
        put_le(t + T_NE + U32_SIZE * i, ne[i], U32_SIZE);
        put_le(t + T_NB + U32_SIZE * i, nb, U32_SIZE);
        nb *= ne[i];
    }
    put_le(t + T_DATA, data, U64_SIZE);
}

/* SET_TENSOR of the whole tensor: 6.0.0 tensor|offset|data, 7.0.0 and 8.0.0 tensor|cache_flag|offset|data. */
static void set_tensor(const uint8_t *t, const float *values) {
    int v6 = major_version == MAJOR_V6;
    size_t header = v6 ? SET_HEADER_V6 : SET_HEADER_V7;
    uint8_t msg[SET_HEADER_V7 + NBYTES];
    memset(msg, 0, sizeof msg);
    memcpy(msg, t, TENSOR_SIZE);
    if (v6) {
        put_le(msg + SET_OFFSET_V6, 0, U64_SIZE); /* PROTOCOL.md#v6-set_tensor */
    } else {
        msg[SET_CACHE_FLAG_V7] = 0; /* not to be cached: PROTOCOL.md#v7-cache-rule */
        put_le(msg + SET_OFFSET_V7, 0, U64_SIZE); /* PROTOCOL.md#v7-set_tensor, #v8-set_tensor */
    }
    for (int i = 0; i < NELEM; i++) {
        put_f32(msg + header + F32_SIZE * i, values[i]);
    }
    request(CMD_SET_TENSOR, msg, header + NBYTES);
}

/* GET_TENSOR of the whole tensor: offset 0, nbytes bytes (PROTOCOL.md#compute step 5). */
static void get_tensor(const uint8_t *t, float *values) {
    uint8_t req[GET_REQ], out[NBYTES];
    memcpy(req, t, TENSOR_SIZE);
    put_le(req + GET_OFFSET, 0, U64_SIZE);
    put_le(req + GET_SIZE, NBYTES, U64_SIZE);
    request(CMD_GET_TENSOR, req, GET_REQ);
    reply(out, NBYTES);
    for (int i = 0; i < NELEM; i++) {
        values[i] = get_f32(out + F32_SIZE * i);
    }
}

/* GRAPH_COMPUTE of one node and its tensors (PROTOCOL.md#compute step 4; 8.0.0 adds the uid, #v8-graph_compute). */
static void graph_compute(uint64_t node, const uint8_t *tensors, int n_tensors, uint64_t uid) {
    int v8 = major_version >= MAJOR_V8;
    size_t n_nodes_at = v8 ? GRAPH_N_NODES_V8 : GRAPH_N_NODES_V6;
    size_t nodes_at = v8 ? GRAPH_NODES_V8 : GRAPH_NODES_V6;
    size_t n_tensors_at = nodes_at + NODE_ID_SIZE; /* one node */
    size_t tensors_at = n_tensors_at + U32_SIZE;
    uint8_t msg[GRAPH_NODES_V8 + NODE_ID_SIZE + U32_SIZE + N_TENSORS * TENSOR_SIZE];
    memset(msg, 0, sizeof msg);
    put_le(msg, 0, U32_SIZE); /* device 0 */
    if (v8) {
        put_le(msg + GRAPH_UID_V8, uid, U64_SIZE);
    }
    put_le(msg + n_nodes_at, 1, U32_SIZE);
    put_le(msg + nodes_at, node, U64_SIZE);
    put_le(msg + n_tensors_at, (uint64_t)n_tensors, U32_SIZE);
    memcpy(msg + tensors_at, tensors, (size_t)n_tensors * TENSOR_SIZE);
    request(CMD_GRAPH_COMPUTE, msg, tensors_at + (size_t)n_tensors * TENSOR_SIZE);
}

/* GRAPH_RECOMPUTE: 6.0.0/7.0.0 name the device (its last graph), 8.0.0 also the uid (PROTOCOL.md#v8-graph-cache). */
static void graph_recompute(uint64_t uid) {
    uint8_t req[RECOMPUTE_REQ_V8];
    memset(req, 0, sizeof req);
    put_le(req, 0, U32_SIZE); /* device 0 */
    if (major_version >= MAJOR_V8) {
        put_le(req + RECOMPUTE_UID_V8, uid, U64_SIZE);
        request(CMD_GRAPH_RECOMPUTE, req, RECOMPUTE_REQ_V8);
    } else {
        request(CMD_GRAPH_RECOMPUTE, req, RECOMPUTE_REQ_V6);
    }
}

static void free_buffer(uint64_t remote_ptr) {
    uint8_t req[FREE_REQ];
    put_le(req, remote_ptr, U64_SIZE);
    request(CMD_FREE_BUFFER, req, FREE_REQ);
}

/* ---- the run ---- */

static int same(const float *got, const float *want, const char *what) {
    for (int i = 0; i < NELEM; i++) {
        if (got[i] != want[i]) {
            printf("%s: element %d is %g, expected %g\n", what, i, (double)got[i], (double)want[i]);
            return 0;
        }
    }
    printf("%s: ok\n", what);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != N_ARGS) {
        fprintf(stderr, "usage: rpc_client HOST PORT MAJOR\n");
        return EXIT_FAILURE_RPC;
    }
    major_version = atoi(argv[ARG_MAJOR]);
    if (major_version != MAJOR_V6 && major_version != MAJOR_V7 && major_version != MAJOR_V8) {
        fail(EXIT_FAILURE_RPC, "MAJOR must be 6, 7 or 8");
    }
    connect_to(argv[ARG_HOST], argv[ARG_PORT]);
    hello();

    /* PROTOCOL.md#session and #alignment: every tensor at a multiple of the alignment from the base. */
    uint64_t alignment = get_alignment();
    printf("alignment %llu\n", (unsigned long long)alignment);
    if (alignment == 0) {
        fail(EXIT_FAILURE_RPC, "alignment 0");
    }
    uint64_t slot = (NBYTES + alignment - 1) / alignment * alignment;
    uint64_t remote_ptr = alloc_buffer(N_TENSORS * slot);
    if (remote_ptr == 0) {
        fail(EXIT_FAILURE_RPC, "ALLOC_BUFFER: remote_ptr 0, the server could not allocate");
    }
    uint64_t base = buffer_get_base(remote_ptr);

    /* PROTOCOL.md#compute-example: a and b are leaves (op NONE, no flag), c = ADD(a, b). */
    uint8_t tensors[N_TENSORS * TENSOR_SIZE];
    uint8_t *a = tensors, *b = tensors + TENSOR_SIZE, *c = tensors + (N_TENSORS - 1) * TENSOR_SIZE;
    tensor(a, ID_A, remote_ptr, base);
    tensor(b, ID_B, remote_ptr, base + slot);
    tensor(c, ID_C, remote_ptr, base + (N_TENSORS - 1) * slot);
    put_le(c + T_OP, OP_ADD, U32_SIZE);
    put_le(c + T_SRC, ID_A, U64_SIZE);
    put_le(c + T_SRC + U64_SIZE, ID_B, U64_SIZE);

    float va[NELEM], vb[NELEM], vc[NELEM], want[NELEM], got[NELEM];
    for (int i = 0; i < NELEM; i++) {
        va[i] = (float)(i + 1);
        vb[i] = (float)(B_SCALE * (i + 1));
        vc[i] = SENTINEL;
    }
    set_tensor(a, va);
    set_tensor(b, vb);
    set_tensor(c, vc);
    int ok = 1;

    /* PROTOCOL.md#compute step 3: without COMPUTE the node is skipped, silently. */
    graph_compute(ID_C, tensors, N_TENSORS, UID_PLAIN);
    get_tensor(c, got);
    ok &= same(got, vc, "without COMPUTE, c keeps its bytes");

    /* With flags & COMPUTE: computed; GET_TENSOR's reply also says the graph was accepted (#failures). */
    put_le(c + T_FLAGS, FLAG_COMPUTE, U32_SIZE);
    graph_compute(ID_C, tensors, N_TENSORS, UID_ADD);
    get_tensor(c, got);
    for (int i = 0; i < NELEM; i++) {
        want[i] = va[i] + vb[i];
    }
    ok &= same(got, want, "with COMPUTE, c = a + b");

    /* GRAPH_RECOMPUTE runs the stored graph on the tensors' current data. */
    for (int i = 0; i < NELEM; i++) {
        va[i] = -va[i];
        want[i] = va[i] + vb[i];
    }
    set_tensor(a, va);
    graph_recompute(UID_ADD);
    get_tensor(c, got);
    ok &= same(got, want, "GRAPH_RECOMPUTE after a new a");

    /* FREE_BUFFER has no reply: a GET_ALIGNMENT after it says that it was accepted (PROTOCOL.md#failures). */
    free_buffer(remote_ptr);
    get_alignment();
    printf("free_buffer: ok\n");
    close(sock);
    return ok ? 0 : EXIT_WRONG;
}
