/* A minimal NVTX tool for tests/multigpu/test_nvtx.py: loaded through NVTX_INJECTION64_PATH, it
 * records the domain ranges a process opens and closes, one line each, into the file named by
 * JAX_UB_NVTX_LOG (suffixed with the process id):
 *   create <domain name> <handle>
 *   push <thread> <handle> <payload> <message>
 *   pop <thread> <handle>
 * Only what jax_ub uses is hooked: nvtxDomainCreateA, nvtxDomainRangePushEx, nvtxDomainRangePop.
 * NVTX initializes a tool once per client library that uses it (jax_ub's extension, XLA, ...), so
 * this initialization runs several times in one process: the log is opened once, for appending.
 */
#include <nvtx3/nvToolsExt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static FILE* g_log = NULL;
static struct nvtxDomainRegistration_st* g_next = (struct nvtxDomainRegistration_st*)0x1000;

static nvtxDomainHandle_t create_a(const char* name) {
  nvtxDomainHandle_t h = (nvtxDomainHandle_t)g_next;
  g_next = (struct nvtxDomainRegistration_st*)((char*)g_next + 16);
  fprintf(g_log, "create %s %p\n", name, (void*)h);
  fflush(g_log);
  return h;
}

static int push_ex(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
  const char* msg = a->messageType == NVTX_MESSAGE_TYPE_ASCII ? a->message.ascii : "?";
  long long payload = a->payloadType == NVTX_PAYLOAD_TYPE_INT64 ? a->payload.llValue : -1;
  fprintf(g_log, "push %lu %p %lld %s\n", (unsigned long)pthread_self(), (void*)d, payload, msg);
  fflush(g_log);
  return 0;
}

static int pop(nvtxDomainHandle_t d) {
  fprintf(g_log, "pop %lu %p\n", (unsigned long)pthread_self(), (void*)d);
  fflush(g_log);
  return 0;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
  const char* base = getenv("JAX_UB_NVTX_LOG");
  if (base == NULL) return 0;
  if (g_log == NULL) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", base, (int)getpid());
    g_log = fopen(path, "a");
    if (g_log == NULL) return 0;
  }
  const NvtxExportTableCallbacks* cb =
      (const NvtxExportTableCallbacks*)get_table(NVTX_ETID_CALLBACKS);
  NvtxFunctionTable table = NULL;
  unsigned int size = 0;
  if (cb == NULL || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size)) return 0;
  if (size <= NVTX_CBID_CORE2_DomainCreateA) return 0;
  *table[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)create_a;
  *table[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)push_ex;
  *table[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)pop;
  return 1;
}
