// A first sleep's copy, four ways: 20 GiB (or N) of device memory to fresh host memory
// (an mmap with MADV_HUGEPAGE, as a VirtualPool's host copies are made), on T threads
// (issue 51 item 3, BENCHMARKS.md "First sleep").
//
//   nvcc -O2 -o first_sleep benches/gpu/first_sleep.cu -lpthread
//   ./first_sleep [GiB, 20] [threads, 16] [ways, 4]
//
// A: staged, what memres did: two pinned buffers of 4 MiB per thread, each thread has the
//    device copy one chunk into a buffer while it copies the other into the host copy.
// B: per 256 MiB copy (one thread each), per 32 MiB: write a byte a page (backing it),
//    cudaHostRegister, then a copy straight into it (what memres does now).
// C: as B without the writes: the registration backs the pages.
// D: as B in pieces of 256 MiB.
// Each way twice, in turn; seconds and GiB/s, the threads' time in cudaHostRegister, and
// the time to unregister afterwards.
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#define CK(x) do{cudaError_t e=(x); if(e){printf("%s:%d %s\n",__FILE__,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
static size_t TOTAL, COPY=256<<20, PIECE_=32<<20, CH=4<<20; static int T=16, MODE; static char *dev, *host; static volatile size_t nexti;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double reg_s[64];
static void *work(void*a){ long id=(long)a; cudaStream_t s[2]; CK(cudaStreamCreateWithFlags(&s[0],cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s[1],cudaStreamNonBlocking));
 if(MODE==0){ char*buf[2]; CK(cudaHostAlloc((void**)&buf[0],CH,0)); CK(cudaHostAlloc((void**)&buf[1],CH,0)); long pend[2]={-1,-1}; int turn=0;
  for(;;){ size_t c=__sync_fetch_and_add(&nexti,1); if(c*CH>=TOTAL) break; int i=turn++%2;
   if(pend[i]>=0){CK(cudaStreamSynchronize(s[i])); memcpy(host+pend[i]*CH,buf[i],CH);} CK(cudaMemcpyAsync(buf[i],dev+c*CH,CH,cudaMemcpyDeviceToHost,s[i])); pend[i]=c; }
  for(int i=0;i<2;i++) if(pend[i]>=0){CK(cudaStreamSynchronize(s[i])); memcpy(host+pend[i]*CH,buf[i],CH);} }
 else { size_t piece = MODE==3? COPY: PIECE_; int k=0;
  for(;;){ size_t c=__sync_fetch_and_add(&nexti,1); if(c*COPY>=TOTAL) break;
   for(size_t o=0;o<COPY;o+=piece){ char*p=host+c*COPY+o; if(MODE!=2) for(size_t q=0;q<piece;q+=4096) p[q]=0;
    double t0=now(); CK(cudaHostRegister(p,piece,cudaHostRegisterPortable)); reg_s[id]+=now()-t0;
    CK(cudaMemcpyAsync(p,dev+c*COPY+o,piece,cudaMemcpyDeviceToHost,s[k++%2])); } }
  CK(cudaStreamSynchronize(s[0])); CK(cudaStreamSynchronize(s[1])); }
 return 0; }
int main(int argc,char**argv){ TOTAL=(size_t)atoi(argv[1])<<30; T=atoi(argv[2]); int modes=argc>3?atoi(argv[3]):4;
 CK(cudaMalloc((void**)&dev,TOTAL)); CK(cudaMemset(dev,3,TOTAL)); CK(cudaDeviceSynchronize());
 const char*names[]={"A staged (memres now)","B touch+register 32MiB+direct","C register 32MiB (no touch)+direct","D touch+register 256MiB+direct"};
 for(int rep=0;rep<2;rep++) for(MODE=0;MODE<modes;MODE++){ char*raw=(char*)mmap(0,TOTAL+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE,-1,0);
  host=(char*)(((size_t)raw+(2<<20)-1)&~((size_t)(2<<20)-1)); madvise(host,TOTAL,MADV_HUGEPAGE); nexti=0; memset(reg_s,0,sizeof reg_s);
  pthread_t th[64]; double t0=now(); for(long i=0;i<T;i++) pthread_create(&th[i],0,work,(void*)i); for(int i=0;i<T;i++) pthread_join(th[i],0); double t=now()-t0;
  double rs=0; for(int i=0;i<T;i++) rs+=reg_s[i];
  int ok = host[TOTAL-1]==3 && host[12345]==3;
  double u0=now(); if(MODE){ size_t piece= MODE==3?COPY:PIECE_; for(size_t o=0;o<TOTAL;o+=piece) CK(cudaHostUnregister(host+o)); }
  double ut=now()-u0; munmap(raw,TOTAL+(2<<20));
  printf("%-36s threads %2d: %.3f s = %5.1f GiB/s (register total %.2f thread-s; unregister %.3f s; bytes ok %d)\n",names[MODE],T,t,(TOTAL>>30)/t,rs,ut,ok); fflush(stdout);}
 return 0; }
