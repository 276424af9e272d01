set -u
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%T
for r in 1 2 3; do for b in old new; do
  echo "== $b round $r"; MEMRES_WORKLOADS=random-mt,random-1stream timeout 100 target/ab/$b-wl arena 2>/dev/null | grep arena
done; done
date -u +%T
bash benches/gpu/speed.sh 2>&1 | tail -60
date -u +%T
