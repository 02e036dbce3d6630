/* A stand-in for libnccl, for the CPU suite only: NCCL needs a GPU, and the parts of
 * weightsync.transport.nccl_lib and nccl.join_communicator checked with it are the
 * calls weightsync makes and the order it makes them in (the config it passes, its
 * polling of a non-blocking communicator, its aborts), not NCCL's own work.
 *
 * Each NCCL call it knows appends a letter to a log (I init, E async-error poll,
 * B broadcast, A abort). stub_set(init_polls, broadcast_polls, fail_state) says how
 * many polls after an init or a broadcast still answer ncclInProgress (-1: forever)
 * and what the state is after that (0: success). Built with -DOLD_NCCL it has no
 * ncclCommInitRankConfig, as NCCL before 2.14.
 */
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } nccl_unique_id;
typedef struct { size_t size; unsigned int magic; unsigned int version; int blocking; } nccl_config;

enum { SUCCESS = 0, IN_PROGRESS = 7 };

static int init_polls, broadcast_polls, fail_state;
static int pending;          /* polls left answering in-progress; -1 forever */
static nccl_config seen;     /* the last config passed to ncclCommInitRankConfig */
static int seen_nranks = -1, seen_rank = -1;
static char calls[4096];
static int ncalls;

static void note(char c) {
    if (ncalls < (int)sizeof(calls) - 1) calls[ncalls++] = c;
}

void stub_set(int init, int broadcast, int state) {
    init_polls = init;
    broadcast_polls = broadcast;
    fail_state = state;
    pending = 0;
    ncalls = 0;
    memset(calls, 0, sizeof(calls));
    memset(&seen, 0, sizeof(seen));
}

const char *stub_calls(void) { return calls; }
size_t stub_config_size(void) { return seen.size; }
unsigned int stub_config_magic(void) { return seen.magic; }
unsigned int stub_config_version(void) { return seen.version; }
int stub_config_blocking(void) { return seen.blocking; }
int stub_nranks(void) { return seen_nranks; }
int stub_rank(void) { return seen_rank; }

int ncclGetVersion(int *version) { *version = 22809; return SUCCESS; }

int ncclGetUniqueId(nccl_unique_id *id) {
    memset(id->internal, 0x5a, sizeof(id->internal));
    return SUCCESS;
}

const char *ncclGetErrorString(int status) { return status == 6 ? "remote process exited" : "stand-in error"; }

int ncclCommInitRank(void **comm, int nranks, nccl_unique_id id, int rank) {
    (void)id;
    note('i');
    seen_nranks = nranks;
    seen_rank = rank;
    *comm = malloc(8);
    return SUCCESS;
}

#ifndef OLD_NCCL /* NCCL before 2.14 has no ncclCommInitRankConfig */
int ncclCommInitRankConfig(void **comm, int nranks, nccl_unique_id id, int rank, nccl_config *config) {
    (void)id;
    note('I');
    memcpy(&seen, config, config->size < sizeof(seen) ? config->size : sizeof(seen));
    seen_nranks = nranks;
    seen_rank = rank;
    *comm = malloc(8);
    pending = init_polls;
    return pending ? IN_PROGRESS : SUCCESS;
}
#endif

int ncclCommGetAsyncError(void *comm, int *state) {
    (void)comm;
    note('E');
    if (pending < 0) { *state = IN_PROGRESS; return SUCCESS; }
    if (pending > 0) { pending--; *state = IN_PROGRESS; return SUCCESS; }
    *state = fail_state;
    return SUCCESS;
}

int ncclBroadcast(const void *send, void *recv, size_t count, int type, int root, void *comm, void *stream) {
    (void)send; (void)recv; (void)count; (void)type; (void)root; (void)comm; (void)stream;
    note('B');
    pending = broadcast_polls;
    return pending ? IN_PROGRESS : SUCCESS;
}

int ncclCommAbort(void *comm) {
    note('A');
    pending = 0;
    free(comm);
    return SUCCESS;
}
