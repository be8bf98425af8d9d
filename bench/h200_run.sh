#!/usr/bin/env bash
# The H200 runs behind the README's GPU tables, as one device call.
#
# The GPU image has torch, triton and grpcio but not Ray: `python bench/gpu_site.py` packs the
# serving stack into .gpu-wheels/site.tar.xz, which travels with the call (carry it; for the
# in-process stages alone, `--engine-only`'s .gpu-wheels/site_engine.tar.xz will do). Each stage
# writes its log to $OUT/<stage>.log (a call brings back at most 8 files), so a call that runs
# out of time still returns the stages it finished. Stages: nvidia budget budget256 hops serve
# graph chain overlap direct sockets local local_chain local_interval local_hops local_profile
# local_profile_tcp rtt core core_overlap core_interval colocated budget_ab budget_cont
# budget_heldout budget_cont_heldout arrivals
# arrivals_ab ttft_ab steps steps_ab ttft ttft_direct ttft_sockets fake features features_test graphs_test
# drain_ab gate_steps
# startup gate
# (default: nvidia budget hops serve).
#
#   bash bench/h200_run.sh budget hops
set -uo pipefail
OUT=${OUT:-bench/out/h200}
mkdir -p "$OUT" /tmp/site
# Whichever site was carried: the whole serving stack, or the engine's (`gpu_site.py
# --engine-only`, for the in-process stages, when the tree and the whole stack pass 64 MiB).
for site in .gpu-wheels/site.tar.xz .gpu-wheels/site_engine.tar.xz; do
  [ -f "$site" ] && tar -xJf "$site" -C /tmp/site
done
export PYTHONPATH=.:/tmp/site PATH="/tmp/site/bin:$PATH" RAY_AUTH_MODE=disabled
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(nvidia budget hops serve)

run() {  # run STAGE TIMEOUT_S COMMAND...: time-bounded, logged, never stops the others
  local stage=$1 limit=$2
  shift 2
  echo "== $stage: $*" | tee -a "$OUT/stages.log"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$stage.log" 2>&1
  echo "== $stage: rc=$? in $((SECONDS - start)) s" | tee -a "$OUT/stages.log"
  tail -n 40 "$OUT/$stage.log"
}

for stage in "${STAGES[@]}"; do
  case $stage in
    nvidia) run nvidia 20 nvidia-smi ;;
    budget) run budget 200 python3 bench/budget_sweep.py --device cuda --dtype bfloat16 \
      --max-tokens 64 --repeats 9 --out-dir /tmp/budget --traces /tmp/budget/budget_traces_cuda.json
      cp /tmp/budget/budget_sweep.json /tmp/budget/budget_sweep.png /tmp/budget/budget_build_cost_cuda.json \
        /tmp/budget/budget_cost_cuda.json "$OUT/"  # the cost file: --virtual-cost, --simulate-cost
      xz -c /tmp/budget/budget_traces_cuda.json >"$OUT/budget_traces_cuda.json.xz" ;;
    budget_cont) run budget_cont 300 python3 bench/budget_sweep.py --device cuda --dtype bfloat16 \
      --max-tokens 64 --requests-per-slot 4 --repeats 5 --out-dir /tmp/budget_cont --traces /tmp/budget_cont/traces.json
      cp /tmp/budget_cont/budget_sweep.json "$OUT/budget_cont.json" ;;
    budget_heldout|budget_cont_heldout)  # the same on held-out text, other windows each round
      cont=$([ "$stage" = budget_cont_heldout ] && echo "--requests-per-slot 4 --repeats 5" || echo "--repeats 9")
      run "$stage" 300 python3 bench/budget_sweep.py --device cuda --dtype bfloat16 --max-tokens 64 \
        --prompt-set heldout $cont --out-dir "/tmp/$stage" --traces "/tmp/$stage/traces.json"
      cp "/tmp/$stage/budget_sweep.json" "$OUT/$stage.json" ;;
    arrivals) run arrivals 240 python3 bench/arrival_costs.py --device cuda --dtype bfloat16 \
      --concurrency 1 16 64 --out-dir /tmp/arrivals ;;
    budget_ab)  # base (bench/ab_base.sh, carried) and head in turn, AB_ROUNDS rounds (2), one warm machine;
      # nine paired rounds each (three left closed means 0.90-0.99 apart on one machine); AB_ARGS:
      # more budget_sweep.py arguments for both, later ones winning (--requests-per-slot 4 --repeats 5)
      ln -sfn "$PWD/ddtree_serve/bundled" bench/out/base_src/ddtree_serve/bundled
      rounds=$(seq 1 "${AB_ROUNDS:-2}")
      for round in $rounds; do
        PYTHONPATH=bench/out/base_src:/tmp/site run "budget_base$round" 240 python3 bench/budget_sweep.py \
          --device cuda --dtype bfloat16 --max-tokens 64 --repeats 9 --out-dir "/tmp/budget_base$round" ${AB_ARGS:-}
        run "budget_head$round" 240 python3 bench/budget_sweep.py --device cuda --dtype bfloat16 \
          --max-tokens 64 --repeats 9 --out-dir "/tmp/budget_head$round" ${AB_ARGS:-}
      done
      tar -cf "$OUT/budget_ab_json.tar" -C /tmp $(for round in $rounds; do
        echo "budget_base$round/budget_sweep.json budget_head$round/budget_sweep.json"; done)
      python3 bench/ab_summary.py --base /tmp/budget_base*/budget_sweep.json \
        --head /tmp/budget_head*/budget_sweep.json | tee "$OUT/ab_summary.md" ;;
    arrivals_ab|ttft_ab)  # base (bench/ab_base.sh, carried) then head, on one machine: what an
      # arrival costs (arrival_costs.py), or a served first token's parts (ttft_breakdown.py)
      ln -sfn "$PWD/ddtree_serve/bundled" bench/out/base_src/ddtree_serve/bundled
      for side in base head; do
        path=$([ "$side" = base ] && echo bench/out/base_src || echo .)
        if [ "$stage" = arrivals_ab ]; then
          PYTHONPATH=$path:/tmp/site run "arrivals_$side" 120 python3 bench/arrival_costs.py \
            --device cuda --dtype bfloat16 --concurrency 1 16 64 --out-dir "/tmp/arrivals_$side"
        else
          PYTHONPATH=$path:/tmp/site run "ttft_$side" 120 python3 bench/ttft_breakdown.py \
            --device cuda --dtype bfloat16 --transport sockets --serve-throughput-optimized --direct-ingress
        fi
      done ;;
    hops) run hops 240 python3 bench/hop_breakdown.py --device cuda --dtype bfloat16 --num-cpus 8 \
      --batch-sizes 1 16 64 --repeats 50 --chunks 50 --steps 20 --rounds 1 ;;
    serve) run serve 300 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --transport actor_calls compiled_graph --stream-batching-interval-ms 0 50 --concurrency 1 4 16 64 ;;
    graph) run graph 200 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --transport compiled_graph --stream-batching-interval-ms 0 50 --concurrency 1 4 16 64 ;;
    chain) run chain 300 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --transport compiled_graph --chain-drafts off on --concurrency 1 4 16 64 --repeats 2 ;;
    overlap) run overlap 420 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --transport actor_calls compiled_graph --overlap off on --concurrency 1 4 16 64 ;;
    direct) run direct 420 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --transport actor_calls compiled_graph --overlap off on --concurrency 1 4 16 64 \
      --serve-throughput-optimized --direct-ingress ;;
    sockets) run sockets 420 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --transport sockets --overlap off on --chain-drafts off on --concurrency 1 4 16 64 \
      --serve-throughput-optimized --direct-ingress ;;
    local) run local 540 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --workers actors target_in_coordinator --transport sockets --overlap off on \
      --concurrency 1 4 16 64 --serve-throughput-optimized --direct-ingress ;;
    local_chain) run local_chain 420 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --workers target_in_coordinator --transport sockets --chain-drafts off on \
      --concurrency 1 4 16 64 --serve-throughput-optimized --direct-ingress ;;
    local_interval) run local_interval 300 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --workers target_in_coordinator --transport sockets --stream-batching-interval-ms 0 50 \
      --concurrency 1 16 64 --serve-throughput-optimized --direct-ingress ;;
    local_hops) run local_hops 240 python3 bench/hop_breakdown.py --device cuda --dtype bfloat16 \
      --num-cpus 8 --batch-sizes 1 16 64 --repeats 50 --chunks 50 --steps 20 --rounds 1 \
      --configurations in_process sockets sockets+chained local_target local_target+chained local_target+overlap ;;
    local_profile) run local_profile 200 python3 bench/hop_breakdown.py --device cuda --dtype bfloat16 \
      --num-cpus 8 --batch-sizes 1 16 64 --repeats 50 --chunks 50 --steps 20 --rounds 1 \
      --configurations in_process local_target --profile 30 ;;
    local_profile_tcp) DDTREE_STEP_SOCKET_FAMILY=tcp run local_profile_tcp 200 python3 bench/hop_breakdown.py \
      --device cuda --dtype bfloat16 --num-cpus 8 --batch-sizes 1 16 64 --repeats 50 --chunks 50 --steps 20 \
      --rounds 1 --configurations in_process local_target --profile 30 ;;
    core) run core 420 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --workers target_in_coordinator engine_core --transport sockets --concurrency 1 16 64 \
      --requests-per-client 6 --serve-throughput-optimized --direct-ingress ;;
    core_overlap) run core_overlap 300 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --workers engine_core --transport sockets --overlap off on --concurrency 1 16 64 \
      --requests-per-client 6 --client-processes 4 --serve-throughput-optimized --direct-ingress ;;
    core_interval) run core_interval 300 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --workers engine_core in_process --transport sockets --stream-batching-interval-ms 50 \
      --concurrency 1 16 64 --requests-per-client 6 --client-processes 4 --serve-throughput-optimized \
      --direct-ingress ;;
    colocated) run colocated 420 python3 bench/serve_load.py --device cuda --dtype bfloat16 \
      --workers engine_core engine_core_colocated in_process --transport sockets \
      --stream-batching-interval-ms 50 --concurrency 1 16 64 --requests-per-client 6 \
      --client-processes 4 --serve-throughput-optimized --direct-ingress ;;
    rtt) run rtt 120 python3 bench/step_socket_rtt.py --batch-sizes 1 16 64 --repeats 500 ;;
    ttft_sockets) run ttft_sockets 120 python3 bench/ttft_breakdown.py --device cuda --dtype bfloat16 \
      --transport sockets --serve-throughput-optimized --direct-ingress ;;
    ttft_direct) run ttft_direct 120 python3 bench/ttft_breakdown.py --device cuda --dtype bfloat16 \
      --transport compiled_graph --serve-throughput-optimized --direct-ingress ;;
    ttft) run ttft 240 bash -c "python3 bench/ttft_breakdown.py --device cuda --dtype bfloat16 --transport actor_calls \
      && python3 bench/ttft_breakdown.py --device cuda --dtype bfloat16 --transport compiled_graph" ;;
    steps) run steps 240 python3 bench/step_stages.py --device cuda --dtype bfloat16 \
      --budgets 8,32,64 --concurrency 1 4 16 64 ;;
    steps_ab)  # step stages of base (bench/ab_base.sh, carried) and head on one machine, the
      # sweep's budgets, where the adaptive engine's host time shows (c = 1-4); eight runs each
      # (four left 0.1 ms unsettled on an H100 in the thirty-second session)
      ln -sfn "$PWD/ddtree_serve/bundled" bench/out/base_src/ddtree_serve/bundled
      for side in base head; do
        path=$([ "$side" = base ] && echo bench/out/base_src || echo .)
        PYTHONPATH=$path:/tmp/site run "steps_$side" 200 python3 bench/step_stages.py --device cuda \
          --dtype bfloat16 --budgets 8,32,64 --concurrency 1 2 4 --runs 8
      done ;;
    drain_ab)  # the drain weights (`DRAIN_POWER`) A/B'd in one process per load: default (off)
      # against drain_power=1 and 4, closed 256 and 64 tokens and held 64 (step_kinds.py)
      kinds="python3 bench/step_kinds.py --device cuda --dtype bfloat16 --budgets 8,32,64 \
        --variant drain_power=1 --variant drain_power=4"
      run drain_ab_256 200 $kinds --max-tokens 256 --max-seq-len 1024 --concurrency 1,2,4,8,16 --rounds 6
      run drain_ab_64 150 $kinds --max-tokens 64 --concurrency 4,8,16,32,64 --rounds 8
      run drain_ab_held 150 $kinds --max-tokens 64 --requests-per-slot 4 --concurrency 4,16,64 \
        --warmup-runs 1 --rounds 4 ;;
    gate_steps)  # the adaptive steps one by one where HEAD misses most: closed 256-token c = 16
      # and held 64-token c = 8 (gate_steps.py)
      run gate_steps_256 150 python3 bench/gate_steps.py --device cuda --dtype bfloat16 --max-seq-len 1024 \
        --max-tokens 256 --level 16
      run gate_steps_held 150 python3 bench/gate_steps.py --device cuda --dtype bfloat16 --max-tokens 64 \
        --level 8 --requests-per-slot 4 ;;
    budget256) run budget256 240 python3 bench/budget_sweep.py --device cuda --dtype bfloat16 \
      --max-tokens 256 --max-seq-len 1024 --out-dir /tmp/budget256 --traces /tmp/budget256/traces.json
      cp /tmp/budget256/budget_sweep.json "$OUT/budget256_sweep.json" ;;  # plot it with --replot
    gate) run gate 200 python3 bench/gate_diagnosis.py --device cuda --dtype bfloat16 \
      --concurrency 1,16,64 --max-tokens 64 --out-dir /tmp/gate ;;
    fake) run fake 150 python3 bench/fake_device.py --concurrency 1 4 16 64 --repeats 2 ;;
    features) run features 150 python3 bench/feature_delivery.py --batch-sizes 1 16 64 --repeats 30 ;;
    features_test) run features_test 300 python3 -m pytest -q -p no:cacheprovider tests/serve/test_device_features.py ;;
    graphs_test) run graphs_test 300 python3 -m pytest -q -p no:cacheprovider tests/models/test_cuda_graphs.py \
      tests/engine/test_graph_warmup.py ;;
    startup) run startup 240 python3 bench/startup_capture.py --budget 64 --max-num-seqs 64 --concurrency 16 ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
