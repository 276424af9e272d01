// How fast threads back fresh anonymous memory (issue 51 item 3, BENCHMARKS.md "First
// sleep"): SIZE GiB mapped with MADV_HUGEPAGE (huge=1) or MADV_NOHUGEPAGE (huge=0),
// backed by T threads taking 4 MiB chunks in turn, one of four ways: 0 a write per 4 KiB
// page, 1 memcpy from a buffer, 2 MADV_POPULATE_WRITE, 3 populate then memcpy.
//
//   cc -O2 -pthread -o host_faults benches/gpu/host_faults.c
//   ./host_faults SIZE_GIB THREADS WAY HUGE
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static size_t SIZE, CH = 4 << 20; static int T, MODE, HUGE; static char *base; static char *src[64];
static volatile size_t next_chunk;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void *work(void *a){ long id=(long)a; for(;;){ size_t c=__sync_fetch_and_add(&next_chunk,1); if(c*CH>=SIZE) break; char*p=base+c*CH;
 if(MODE==0){for(size_t o=0;o<CH;o+=4096) p[o]=1;}
 else if(MODE==1){memcpy(p,src[id],CH);}
 else if(MODE==2){if(madvise(p,CH,MADV_POPULATE_WRITE)) {perror("populate"); exit(1);}}
 else {madvise(p,CH,MADV_POPULATE_WRITE); memcpy(p,src[id],CH);} } return 0; }
int main(int argc,char**argv){ SIZE=(size_t)atoi(argv[1])<<30; T=atoi(argv[2]); MODE=atoi(argv[3]); HUGE=atoi(argv[4]);
 for(int i=0;i<T;i++){src[i]=malloc(CH);memset(src[i],7,CH);}
 char*raw=mmap(0,SIZE+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE,-1,0);
 base=(char*)(((size_t)raw+(2<<20)-1)&~((size_t)(2<<20)-1)); if(HUGE) madvise(base,SIZE,MADV_HUGEPAGE); else madvise(base,SIZE,MADV_NOHUGEPAGE);
 pthread_t th[64]; double t0=now(); for(long i=0;i<T;i++) pthread_create(&th[i],0,work,(void*)i); for(int i=0;i<T;i++) pthread_join(th[i],0);
 double t=now()-t0; const char*m[]={"touch","memcpy","populate","populate+memcpy"};
 printf("%-16s huge=%d threads=%2d: %.3f s, %.1f GiB/s\n",m[MODE],HUGE,T,t,(SIZE>>30)/t); return 0; }
