// The one part of NCCL that bun:ffi cannot call: communicator creation takes an ncclUniqueId
// (a 128-byte struct) BY VALUE. bun:ffi passes only scalars and pointers, and declaring the
// argument as a pointer is silently wrong: on x86-64 a 128-byte struct travels on the stack,
// so a pointer in its place shifts every later argument into the wrong register (`rank` would
// be read from the pointer's register) and NCCL reads stack garbage as the id. (aarch64 passes
// large structs through a pointer to a copy, so the mistake would even seem to work there.)
// This shim takes the 128 bytes through a pointer and makes the by-value call in C. Every
// other NCCL function takes only pointers and ints and is called from TypeScript directly.
//
// nccl.h is not needed to build it (machines without a GPU build it too): the few ABI pieces
// used are declared below, each checked against NCCL's own header.
//
// Threads: no function here calls into JavaScript, ever. The one thread this file starts (the
// fallback init for NCCL < 2.14) calls only NCCL and the CUDA driver, and reports by writing
// memory that JavaScript polls.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- NCCL ABI, declared by hand -------------------------------------------------------------
typedef int ncclResult_t;  // an enum in nccl.h: int-sized on every ABI we run on
typedef void* ncclComm_t;  // `struct ncclComm*`
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
#define ncclInProgress 7
#define ncclInvalidUsage 5
#define ncclSystemError 2

// ncclConfig_t as NCCL 2.14.0 declared it (`struct ncclConfig_v21400`: size, magic, version,
// blocking), the version that introduced ncclCommInitRankConfig and the non-blocking mode.
// `blocking` is the one field we set. Later versions only append fields after it (2.17:
// cgaClusterSize, minCTAs, maxCTAs, netName; then splitShare, trafficClass, commName, ...;
// the current header's ncclConfig_v23100 ends with nvlsHostMode), never reordering or removing
// one, and read a caller's struct defensively. In the NCCL sources read for this (2.14's
// ncclCommInitRankConfig; parseCommConfig in a 2.17-era and a 2.30-era src/init.cc): NCCL
// reads `size` first, copies min(size, its own sizeof) bytes over an NCCL_CONFIG_INITIALIZER
// default, rejects
// magic != 0xcafebeef (NCCL_API_MAGIC) with ncclInvalidArgument, and resets to its defaults
// the fields a caller's header version did not know (`version < NCCL_VERSION(2,17,0)` resets
// cgaClusterSize, minCTAs, maxCTAs, netName; `< 2.25` trafficClass; `< 2.27` collnetEnable,
// CTAPolicy, shrinkShare, nvlsCTAs; and so on). So the 2.14 struct with exactly what 2.14's
// NCCL_CONFIG_INITIALIZER writes -- size = sizeof = 24, magic = 0xcafebeef, version =
// NCCL_VERSION(2,14,0) = 21400 -- is read correctly by every NCCL >= 2.14, and each field we
// do not declare takes NCCL's default. (The 4 bytes of tail padding overlap 2.17+'s
// cgaClusterSize: see the memset where the struct is filled.)
typedef struct {
  size_t size;           // sizeof(this struct): 24 on LP64 (8 + 4 + 4 + 4, padded to 8; see the memset below)
  unsigned int magic;    // NCCL_API_MAGIC
  unsigned int version;  // NCCL_VERSION(2,14,0): the version whose fields are declared here
  int blocking;          // 0: every call may return ncclInProgress instead of blocking
} mt_nccl_config_v21400;
#define NCCL_API_MAGIC 0xcafebeefu
#define MT_NCCL_CONFIG_VERSION 21400  // NCCL_VERSION(2,14,0) = 2*10000 + 14*100 + 0

typedef ncclResult_t (*init_rank_config_fn)(ncclComm_t*, int, ncclUniqueId, int, mt_nccl_config_v21400*);
typedef ncclResult_t (*init_rank_fn)(ncclComm_t*, int, ncclUniqueId, int);
typedef ncclResult_t (*comm_abort_fn)(ncclComm_t);
// CUDA driver: the context current on the calling thread, carried to the fallback init thread.
typedef int (*cu_ctx_get_fn)(void**);
typedef int (*cu_ctx_set_fn)(void*);

/** One loaded libnccl. A process normally has one; tests load a fake beside another. */
typedef struct {
  void* lib;
  init_rank_config_fn init_rank_config;  // NULL before 2.14
  init_rank_fn init_rank;
  comm_abort_fn comm_abort;
} mt_nccl;

static void set_error(char* err, int errlen, const char* what, const char* detail) {
  if (err == NULL || errlen <= 0) return;
  snprintf(err, (size_t)errlen, "%s%s%s", what, detail ? ": " : "", detail ? detail : "");
}

/** Loads libnccl from `path`. A handle on success; NULL with a message in err otherwise. */
void* mt_nccl_open(const char* path, char* err, int errlen) {
  // RTLD_LOCAL: bun:ffi's dlopen of the same path shares this very instance (the loader keys
  // libraries by path and counts references), so both sides see one NCCL.
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    set_error(err, errlen, "dlopen failed", dlerror());
    return NULL;
  }
  mt_nccl* h = (mt_nccl*)calloc(1, sizeof *h);
  if (h == NULL) {
    set_error(err, errlen, "out of memory", NULL);
    dlclose(lib);
    return NULL;
  }
  h->lib = lib;
  h->init_rank = (init_rank_fn)dlsym(lib, "ncclCommInitRank");
  h->comm_abort = (comm_abort_fn)dlsym(lib, "ncclCommAbort");
  h->init_rank_config = (init_rank_config_fn)dlsym(lib, "ncclCommInitRankConfig");
  if (h->init_rank == NULL || h->comm_abort == NULL) {
    set_error(err, errlen, "not an NCCL library (it has no ncclCommInitRank or ncclCommAbort)", path);
    dlclose(lib);
    free(h);
    return NULL;
  }
  return h;
}

/** 1 if the library exports `name`, else 0: TypeScript binds optional symbols only when
 *  present (bun:ffi's dlopen fails outright on a missing one). */
int mt_nccl_has_symbol(void* handle, const char* name) {
  return dlsym(((mt_nccl*)handle)->lib, name) != NULL;
}

/** The config layout this shim passes, for tests and logs: size, magic, version, blocking's offset. */
void mt_nccl_config_layout(int64_t* out4) {
  out4[0] = (int64_t)sizeof(mt_nccl_config_v21400);
  out4[1] = (int64_t)NCCL_API_MAGIC;
  out4[2] = (int64_t)MT_NCCL_CONFIG_VERSION;
  out4[3] = (int64_t)offsetof(mt_nccl_config_v21400, blocking);
}

// ---- non-blocking init (NCCL >= 2.14) -------------------------------------------------------
// NCCL keeps the caller's `ncclComm_t* newcomm` and its init thread writes the communicator
// there again when it finishes (2.14-2.18 set job->newcomm = newcomm; ncclCommInitRankFunc
// stores through it on exit), long after ncclCommInitRankConfig returned. So the slot cannot
// be JavaScript memory or a C stack variable: it is malloc'ed here and freed only after
// ncclCommDestroy or ncclCommAbort, both of which join NCCL's init thread first.
typedef struct {
  ncclComm_t comm;
} mt_comm_slot;

/** ncclCommInitRankConfig(&slot->comm, nranks, id BY VALUE, rank, {blocking}); *result is its
 *  return value (with blocking = 0, usually ncclInProgress: poll ncclCommGetAsyncError).
 *  Returns the slot, which the caller frees with mt_nccl_slot_free after destroy/abort; NULL
 *  when nothing was started (*result: ncclInvalidUsage if the library predates 2.14,
 *  ncclSystemError if out of memory). */
void* mt_nccl_init_rank_config(void* handle, int nranks, const void* id_bytes, int rank, int blocking, int* result) {
  mt_nccl* h = (mt_nccl*)handle;
  if (h->init_rank_config == NULL) {
    *result = ncclInvalidUsage;
    return NULL;
  }
  mt_comm_slot* slot = (mt_comm_slot*)calloc(1, sizeof *slot);
  if (slot == NULL) {
    *result = ncclSystemError;
    return NULL;
  }
  ncclUniqueId id;
  memcpy(&id, id_bytes, sizeof id);
  // memset first: sizeof is 24 with 4 bytes of tail padding, and NCCL >= 2.17 copies all 24
  // bytes, so its cgaClusterSize (offset 20) is read from our padding. NCCL then resets that
  // field to its default because version < 2.17, but the bytes it reads should not be stack
  // garbage all the same (an initializer leaves padding unspecified).
  mt_nccl_config_v21400 config;
  memset(&config, 0, sizeof config);
  config.size = sizeof config;
  config.magic = NCCL_API_MAGIC;
  config.version = MT_NCCL_CONFIG_VERSION;
  config.blocking = blocking;
  // The config, unlike newcomm, is copied during the call (parseCommConfig): a stack struct is fine.
  *result = h->init_rank_config(&slot->comm, nranks, id, rank, &config);
  return slot;
}

/** The communicator in a slot (NULL if NCCL made none). */
void* mt_nccl_slot_comm(void* slot) {
  return __atomic_load_n(&((mt_comm_slot*)slot)->comm, __ATOMIC_ACQUIRE);
}

void mt_nccl_slot_free(void* slot) {
  free(slot);
}

// ---- fallback for NCCL < 2.14: the blocking ncclCommInitRank on a thread of our own ---------
// JavaScript polls the job; the thread never touches JavaScript. States move RUNNING -> DONE
// (the thread finished first) or RUNNING -> ABANDONED (JavaScript gave up first); whoever moves
// second frees the job, so neither side can use it after the other let go.
enum { JOB_RUNNING = 0, JOB_DONE = 1, JOB_ABANDONED = 2 };

typedef struct {
  mt_nccl* nccl;
  ncclUniqueId id;
  int nranks;
  int rank;
  void* cu_context;  // the caller's current CUDA context (NULL if libcuda is not loaded)
  ncclComm_t comm;
  ncclResult_t result;
  _Atomic int state;
} mt_init_job;

static void* cuda_symbol(const char* name) {
  // RTLD_NOLOAD: use libcuda only if the CUDA backend has loaded it; never load it here.
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  void* sym = cuda ? dlsym(cuda, name) : NULL;
  if (cuda) dlclose(cuda);  // drops only the reference NOLOAD added
  return sym;
}

static void* init_thread(void* arg) {
  mt_init_job* job = (mt_init_job*)arg;
  if (job->cu_context != NULL) {
    // NCCL picks its device from the calling thread's current context (cudaGetDevice); a new
    // thread has none, so give it the caller's.
    cu_ctx_set_fn set = (cu_ctx_set_fn)cuda_symbol("cuCtxSetCurrent");
    if (set != NULL) (void)set(job->cu_context);  // a failure surfaces as NCCL's own CUDA error
  }
  ncclComm_t comm = NULL;
  ncclResult_t r = job->nccl->init_rank(&comm, job->nranks, job->id, job->rank);
  job->comm = comm;
  job->result = r;
  if (atomic_exchange(&job->state, JOB_DONE) == JOB_ABANDONED) {
    if (r == 0 && comm != NULL) (void)job->nccl->comm_abort(comm);  // nobody will use it; its error has no one to go to
    free(job);
  }
  return NULL;
}

/** Starts ncclCommInitRank on a detached thread; NULL (and *result set) if it cannot start. */
void* mt_nccl_init_start_legacy(void* handle, int nranks, const void* id_bytes, int rank, int* result) {
  *result = 0;
  mt_init_job* job = (mt_init_job*)calloc(1, sizeof *job);
  if (job == NULL) {
    *result = ncclSystemError;
    return NULL;
  }
  job->nccl = (mt_nccl*)handle;
  memcpy(&job->id, id_bytes, sizeof job->id);
  job->nranks = nranks;
  job->rank = rank;
  cu_ctx_get_fn get = (cu_ctx_get_fn)cuda_symbol("cuCtxGetCurrent");
  if (get != NULL && get(&job->cu_context) != 0) job->cu_context = NULL;
  atomic_init(&job->state, JOB_RUNNING);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  int rc = pthread_create(&thread, &attr, init_thread, job);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    free(job);
    *result = ncclSystemError;
    return NULL;
  }
  return job;
}

/** 0 while the init runs. When it has finished: 1, *comm and *result set, and the job freed
 *  (do not poll it again). */
int mt_nccl_init_poll_legacy(void* handle, void** comm, int* result) {
  mt_init_job* job = (mt_init_job*)handle;
  if (atomic_load(&job->state) != JOB_DONE) return 0;
  *comm = job->comm;
  *result = job->result;
  free(job);
  return 1;
}

/** Gives up on a running init (a timeout): whichever side finishes last aborts the
 *  communicator, if one was made, and frees the job. */
void mt_nccl_init_abandon_legacy(void* handle) {
  mt_init_job* job = (mt_init_job*)handle;
  if (atomic_exchange(&job->state, JOB_ABANDONED) == JOB_DONE) {
    if (job->result == 0 && job->comm != NULL) (void)job->nccl->comm_abort(job->comm);
    free(job);
  }
}
