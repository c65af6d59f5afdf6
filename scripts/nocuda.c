/* A stand-in for the GPU driver's libcuda.so.1 on a host without one: every entry point
   answers CUDA_ERROR_NO_DEVICE (100). sglang 0.5.12's scheduler imports sgl_kernel, whose
   only build links libcuda.so.1; with this on LD_LIBRARY_PATH it loads, and a CUDA call
   fails instead of the import (docs/recording.md, "sglang 0.5.12 on CPU").

       gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o /tmp/nocuda/libcuda.so.1 scripts/nocuda.c */
typedef int CUresult;
#define NO_DEVICE 100
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; if (s) *s = "no CUDA driver (kvreplay's stand-in libcuda)"; return 0; }
CUresult cuMemAddressFree(void) { return NO_DEVICE; }
CUresult cuMemGetAddressRange_v2(void) { return NO_DEVICE; }
CUresult cuMemRelease(void) { return NO_DEVICE; }
CUresult cuMemRetainAllocationHandle(void) { return NO_DEVICE; }
CUresult cuMemSetAccess(void) { return NO_DEVICE; }
CUresult cuMemUnmap(void) { return NO_DEVICE; }
CUresult cuPointerGetAttribute(void) { return NO_DEVICE; }
CUresult cuInit(unsigned f) { (void)f; return NO_DEVICE; }
CUresult cuDriverGetVersion(int *v) { if (v) *v = 0; return NO_DEVICE; }
CUresult cuDeviceGetCount(int *n) { if (n) *n = 0; return NO_DEVICE; }
CUresult cuGetProcAddress(void) { return NO_DEVICE; }
CUresult cuGetProcAddress_v2(void) { return NO_DEVICE; }
