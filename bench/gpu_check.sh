#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): throughput, MFU, compile, fp16, resume and collectives of the
# trainer on the GPUs of this machine, the Llama-3.2-1B shape loaded from a Hugging Face directory
# beside torchtitan on the same shape, and a few blocks of gpt-oss at its real widths (random weights),
# within a time budget (10 minutes by default), each step under `timeout`, one step's failure never
# stopping the others. Run it from the repository root:
#
#   bench/gpu_check.sh [--out DIR] [--only STEPS] [--skip STEPS] [--dry-run] [--plan] ...
#   make gpu-check                      # the same, OUT=... to choose the directory
#
# Writes DIR/summary.json, DIR/summary.md (bench/gpu_summary.py) and DIR/logs.tar.gz (every step's
# arguments, log and metrics); the step directories stay in $GPU_CHECK_WORK (default DIR/steps).
# Exit status: 0 every step passed or was skipped, 1 a step failed, 2 bad arguments, 3 this machine
# cannot run the check (no CUDA torch, no GPU, a module that cannot be installed).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ALL_STEPS=(bf16 compile fp16 resume throughput collectives hf_llama1b torchtitan_llama1b gpt_oss_layers)
declare -A STEP_INFO=(
  [bf16]="gpt-1b, bf16 parameters and fp32 reduction, one GPU: tokens/s, MFU, memory, step time"
  [compile]="the same with parallel.compile=true: compile time apart from the steady state"
  [fp16]="fp16 parameters with GradScaler: losses finite and falling, skipped steps counted"
  [resume]="save, then --resume auto: the resumed losses equal an uninterrupted run's; RNG restored"
  [throughput]="bench/trainer_throughput.py: FSDP2 vs DDP with one rank per GPU"
  [collectives]="trainer.collectives over NCCL (2+ GPUs): all-reduce bus bandwidth by size"
  [hf_llama1b]="Llama-3.2-1B shape loaded from a Hugging Face directory (model.hf_dir), bf16: tokens/s, MFU"
  [torchtitan_llama1b]="torchtitan 0.3.0 on the same shape, batch and sequence: tokens/s, MFU, the ratio"
  [gpt_oss_layers]="gpt-oss widths, a few blocks, random weights: tokens/s, MFU (active parameters), memory; grouped GEMM vs the loop"
)
# Seconds each step may take at most (the budget may leave less).
# hf_llama1b includes writing the Hugging Face directory (2.5 GB) once; torchtitan_llama1b installing its
# wheels and autotuning its FlexAttention kernels (torchtitan/models/common/attention.py: max_autotune).
# gpt_oss_layers initialises and trains a model of 4.5 billion parameters (gpt-oss-20b's width, 4 blocks),
# then compares grouped GEMM with the loop on one block's experts (bench/gpu_check/grouped_check.py).
declare -A STEP_TIMEOUT=([bf16]=120 [compile]=200 [fp16]=90 [resume]=150 [throughput]=150 [collectives]=90
                         [hf_llama1b]=240 [torchtitan_llama1b]=360 [gpt_oss_layers]=300)

usage() {
  cat <<EOF
usage: bench/gpu_check.sh [options]

Runs the GPU check steps in order (${ALL_STEPS[*]}), then writes summary.json and summary.md.

options:
  --out DIR          where summary.json, summary.md and logs.tar.gz go (default: \$OUT, else ./gpu-check-out)
  --only STEPS       comma-separated steps to run (default: all)
  --skip STEPS       comma-separated steps to leave out
  --dry-run          every step on CPU with the tiny config and a few steps (same as GPU_CHECK_DEVICE=cpu)
  --plan             print each step's commands and exit without running anything
  --list             print the steps and what each measures, and exit
  --budget SECONDS   total time for all steps (default: \$GPU_CHECK_BUDGET_S, else 600)
  --wheels DIR       wheels to install missing modules from, offline (default: \$GPU_CHECK_WHEELS, else .whl);
                     torchtitan and its modules from DIR/torchtitan
  --fetch-wheels DIR download those wheels here (needs the network; for a machine without one) and exit
  -h, --help         this help

environment: GPU_CHECK_DEVICE=cuda|cpu, GPU_CHECK_WORK (step directories), GPU_CHECK_SITE (where missing
modules are installed, default /tmp/gpu-check-site), GPU_CHECK_MICRO_BATCH (sequences per GPU, default 8),
GPU_CHECK_PEAK_FLOPS (MFU peak for an unlisted GPU), GPU_CHECK_SET (extra trainer KEY=VALUE settings,
space-separated), GPU_CHECK_LLAMA1B_COMPILE=1 (compile both Llama-3.2-1B runs), GPU_CHECK_GPT_OSS_ARCH
(gpt-oss-20b, the default, or gpt-oss-120b), GPU_CHECK_GPT_OSS_LAYERS (its first blocks, default 4),
GPU_CHECK_GPT_OSS_MICRO_BATCH (its sequences per step, default 4), PYTHON (default python3).
EOF
}

die_usage() { echo "error: $*" >&2; echo "run bench/gpu_check.sh --help for the options" >&2; exit 2; }

# --- arguments -------------------------------------------------------------------------------------
OUT_DIR=${OUT:-./gpu-check-out}
ONLY="" SKIP="" PLAN=0 FETCH="" DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-600}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
need_value() { [[ $# -ge 2 && -n $2 && $2 != --* ]] || die_usage "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) need_value "$@"; OUT_DIR=$2; shift 2 ;;
    --only) need_value "$@"; ONLY=$2; shift 2 ;;
    --skip) need_value "$@"; SKIP=$2; shift 2 ;;
    --budget) need_value "$@"; BUDGET=$2; shift 2 ;;
    --wheels) need_value "$@"; WHEELS=$2; shift 2 ;;
    --fetch-wheels) need_value "$@"; FETCH=$2; shift 2 ;;
    --dry-run) DEVICE=cpu; shift ;;
    --plan) PLAN=1; shift ;;
    --list) for s in "${ALL_STEPS[@]}"; do printf '%-12s %s\n' "$s" "${STEP_INFO[$s]}"; done; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown option '$1'" ;;
  esac
done
case $DEVICE in
  cuda|cpu) ;;
  *) die_usage "GPU_CHECK_DEVICE='$DEVICE' is not a device; use cuda (the default) or cpu (--dry-run)" ;;
esac
[[ $BUDGET =~ ^[0-9]+$ && $BUDGET -ge 60 ]] || die_usage "--budget '$BUDGET' must be a whole number of seconds >= 60"
MICRO_BATCH=${GPU_CHECK_MICRO_BATCH:-8}
[[ $MICRO_BATCH =~ ^[1-9][0-9]*$ ]] || die_usage "GPU_CHECK_MICRO_BATCH='$MICRO_BATCH' must be a positive whole number"
case ${GPU_CHECK_LLAMA1B_COMPILE:-0} in
  0) LLAMA_COMPILE=false ;;
  1) LLAMA_COMPILE=true ;;
  *) die_usage "GPU_CHECK_LLAMA1B_COMPILE='$GPU_CHECK_LLAMA1B_COMPILE' must be 0 (eager, default) or 1" ;;
esac
# gpt_oss_layers: the bundled architecture cut to its first blocks (docs/gpu-check.md, "gpt-oss on one
# GPU": 4 blocks of gpt-oss-20b fit one H200, where one block of gpt-oss-120b's 128 experts is the most
# that does), and its own batch (the attention with sinks holds full fp32 score matrices).
GPT_OSS_ARCH=${GPU_CHECK_GPT_OSS_ARCH:-gpt-oss-20b}
case $GPT_OSS_ARCH in
  gpt-oss-20b|gpt-oss-120b) ;;
  *) die_usage "GPU_CHECK_GPT_OSS_ARCH='$GPT_OSS_ARCH' is not a bundled gpt-oss architecture; use gpt-oss-20b (the default) or gpt-oss-120b" ;;
esac
GPT_OSS_LAYERS=${GPU_CHECK_GPT_OSS_LAYERS:-4}
[[ $GPT_OSS_LAYERS =~ ^[1-9][0-9]*$ ]] || die_usage "GPU_CHECK_GPT_OSS_LAYERS='$GPT_OSS_LAYERS' must be a positive whole number of blocks (default 4)"
GPT_OSS_BATCH=${GPU_CHECK_GPT_OSS_MICRO_BATCH:-4}
[[ $GPT_OSS_BATCH =~ ^[1-9][0-9]*$ ]] || die_usage "GPU_CHECK_GPT_OSS_MICRO_BATCH='$GPT_OSS_BATCH' must be a positive whole number of sequences (default 4)"

check_steps() {  # $1 option name, $2 comma list
  local name
  IFS=, read -ra names <<<"$2"
  [[ ${#names[@]} -gt 0 ]] || die_usage "$1 needs at least one step name (${ALL_STEPS[*]})"
  local known
  known=$(IFS=,; echo "${ALL_STEPS[*]}")
  for name in "${names[@]}"; do
    [[ -n $name ]] || die_usage "$1 '$2' has an empty step name; give e.g. --only bf16,resume (steps: $known)"
    [[ -n ${STEP_INFO[$name]+x} ]] || die_usage "$1: unknown step '$name'; the steps are: $known"
  done
}
[[ -n $ONLY ]] && check_steps --only "$ONLY"
[[ -n $SKIP ]] && check_steps --skip "$SKIP"
selected() {  # is step $1 to run?
  [[ -n $ONLY && ",$ONLY," != *",$1,"* ]] && return 1
  [[ -n $SKIP && ",$SKIP," == *",$1,"* ]] && return 1
  return 0
}

PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
# What the trainer needs beyond torch, numpy and PyYAML (the GPU machine has those; see
# shared/notes/gpu-machine.md), with their dependencies: pydantic; tensorboardX (trainer.tracking);
# boto3 (checkpoint.mirror_s3, trainer.hf.fetch); jinja2 and tokenizers (trainer.tokenizer); safetensors
# (Hugging Face directories). protobuf below 7, as the project's tests run tensorboardX with. Never torch: a pip install must not replace a CUDA build.
HELPER_WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
               tensorboardX "protobuf<7" packaging boto3 botocore s3transfer jmespath urllib3 python-dateutil six
               jinja2 markupsafe tokenizers safetensors)
# torchtitan_llama1b: torchtitan and what importing its training entry point (torchtitan/train.py) needs
# beyond torch, numpy and triton (which comes with CUDA torch), as tested with torchtitan 0.3.0. Not
# `datasets`: it is imported but unused on synthetic data, and with pyarrow and pandas (~70 MB) it would
# not fit the 64 MiB carried to the GPU machine; bench/gpu_check/no_datasets stands in for it. These go
# into DIR/torchtitan and are installed apart from the trainer's modules (only that step sees them).
TITAN_WHEELS=(torchtitan==0.3.0 spmd-types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
              typing-extensions==4.16.0 torchdata==0.11.0 tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1
              tokenizers==0.23.3)

if [[ -n $FETCH ]]; then
  mkdir -p "$FETCH/torchtitan" || { echo "error: cannot create --fetch-wheels directory $FETCH" >&2; exit 2; }
  pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null)
  pyver=${GPU_CHECK_WHEEL_PYTHON:-${pyver:-3.12}}
  download() {  # into $1: the wheels $2... for the target Python, never their dependencies
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$1" "${@:2}"
  }
  echo "downloading ${HELPER_WHEELS[*]} for Python $pyver x86-64 into $FETCH"
  download "$FETCH" "${HELPER_WHEELS[@]}" || exit 1
  echo "downloading ${TITAN_WHEELS[*]} into $FETCH/torchtitan"
  download "$FETCH/torchtitan" "${TITAN_WHEELS[@]}" || exit 1
  du -sh "$FETCH"
  exit 0
fi

# --- the steps' commands ---------------------------------------------------------------------------
if [[ $DEVICE == cuda ]]; then
  CONFIG=gpt-1b BATCH=$MICRO_BATCH
  N_THROUGHPUT=50 N_FP16=30 N_RESUME=20 K_RESUME=10 N_LLAMA=30 N_GPT_OSS=20
  FP16_LR=(--set optim.lr=3e-4 --set optim.warmup_steps=5)
  # The resume step writes two checkpoints: two layers keep them small (about 3 GB) and quick.
  RESUME_MODEL=(--set model.n_layers=2)
  LLAMA_SEQ=2048
  GPT_OSS_WIDTHS=()
else
  CONFIG=tiny BATCH=${GPU_CHECK_MICRO_BATCH:-4}
  N_THROUGHPUT=5 N_FP16=8 N_RESUME=6 K_RESUME=3 N_LLAMA=5 N_GPT_OSS=5
  FP16_LR=()
  RESUME_MODEL=()
  LLAMA_SEQ=64
  GPT_OSS_WIDTHS=(--tiny)  # the same blocks and keys, widths of a few dozen
fi
# One optimizer step = one micro-batch per rank: no accumulation, the whole batch on one GPU.
# A metrics record per step (the summary's medians and warm-up excess are per step; the default log
# interval averages 10 steps into one record).
RUN_SETS=(--set "distributed.device=$DEVICE" --set training.gradient_accumulation=1
          --set parallel.param_dtype=bf16 --set parallel.reduce_dtype=fp32 --set metrics.log_interval=1)
[[ -n ${GPU_CHECK_PEAK_FLOPS:-} ]] && RUN_SETS+=(--set "metrics.peak_flops=$GPU_CHECK_PEAK_FLOPS")
# Extra trainer settings for every trainer step, e.g. GPU_CHECK_SET='optim.fused=true' to measure a
# change against a run without it (space-separated KEY=VALUE).
for setting in ${GPU_CHECK_SET:-}; do
  [[ $setting == *=* ]] || die_usage "GPU_CHECK_SET: '$setting' is not KEY=VALUE (e.g. GPU_CHECK_SET='optim.fused=true')"
  RUN_SETS+=(--set "$setting")
done
SETS=(--set "training.global_batch_size=$BATCH" "${RUN_SETS[@]}")
BASE=(--config "$CONFIG" "${SETS[@]}")
# finetune (trainer/configs/finetune.yaml) is the preset for Hugging Face models; synthetic tokens need no
# tokenizer, and every activation is kept, as in torchtitan_llama1b (finetune checkpoints them).
LLAMA_DATA=(--set data.source=synthetic --set "data.seq_len=$LLAMA_SEQ"
            --set parallel.activation_checkpointing=false)
llama_commands() {  # the hf_llama1b commands, for the current $WORK
  if [[ $DEVICE == cuda ]]; then
    LLAMA_ARCH=llama3.2-1b  # the bundled architecture, trainer/configs/hf/llama3.2-1b.json
  else
    LLAMA_ARCH=$WORK/models/tiny-llama3.json  # written by the step: a few hundred thousand parameters
  fi
  # The Hugging Face directory hf_llama1b trains from, made once per GPU_CHECK_WORK by the trainer itself
  # (a one-step run of the architecture, exported with checkpoint.hf_export_dir): the GPU machine has no
  # network to download one. Kept out of logs.tar.gz.
  LLAMA_DIR=$WORK/models/$(basename "${LLAMA_ARCH%.json}")
  LLAMA_MAKE=(--config finetune --set "model.hf_config=$LLAMA_ARCH" "${LLAMA_DATA[@]}"
              --set "distributed.device=$DEVICE" --set training.global_batch_size=1
              --set training.gradient_accumulation=1 --set "checkpoint.hf_export_dir=$LLAMA_DIR" --steps 1)
  LLAMA=(--config finetune --set "model.hf_dir=$LLAMA_DIR" "${LLAMA_DATA[@]}" "${SETS[@]}"
         --set "parallel.compile=$LLAMA_COMPILE" --steps "$N_LLAMA")
}
# torchtitan_llama1b: its options for bench/gpu_check/titan_llama1b.py's config (torchtitan/config/
# configs.py TrainingConfig and CompileConfig; the trainer's bf16 parameters and fp32 reduction are
# torchtitan's defaults, mixed_precision_param/_reduce). Always the Llama-3.2-1B shape at sequence 2048:
# torchtitan trains on CUDA only, on CPU the step only checks these options.
TITAN=(--training.steps "$N_LLAMA" --training.local_batch_size "$BATCH" --training.seq_len 2048)
[[ $LLAMA_COMPILE == true ]] && TITAN+=(--compile.enable)
TITAN_RUN=(-m torchtitan.train --module titan_llama1b --config llama3_2_1b)
gpt_oss_commands() {  # the gpt_oss_layers commands, for the current $WORK
  # The architecture the step writes (bench/gpu_check/gpt_oss_arch.py) and trains from: random weights, no
  # download (the GPU machine has no network). Synthetic tokens, the sequence of the Llama-3.2-1B steps, the
  # finetune preset's FULL_SHARD and activation checkpointing (as the gpt-oss presets train).
  GPT_OSS_CONFIG=$WORK/gpt_oss_layers/model-config.json
  GPT_OSS_MAKE=(--arch "$GPT_OSS_ARCH" --layers "$GPT_OSS_LAYERS" "${GPT_OSS_WIDTHS[@]}" --output "$GPT_OSS_CONFIG")
  GPT_OSS_SETS=(--set "model.hf_config=$GPT_OSS_CONFIG" --set data.source=synthetic --set "data.seq_len=$LLAMA_SEQ"
                --set "training.global_batch_size=$GPT_OSS_BATCH" "${RUN_SETS[@]}")
  GPT_OSS=(--config finetune "${GPT_OSS_SETS[@]}" --steps "$N_GPT_OSS")
  GROUPED_CHECK=(bench/gpu_check/grouped_check.py --config "$GPT_OSS_CONFIG" --device "$DEVICE"
                 --output "$WORK/gpt_oss_layers/grouped_check.json")
}
FLAT_LR=(--set optim.warmup_steps=0 --set optim.min_lr_ratio=1.0 --set optim.lr=3e-4)
# The resume step's first half runs 2 steps past its checkpoint at step K_RESUME, so that async save is
# staged while training goes on (on CUDA: the pinned copy on a side stream), and the second half
# resumes from exactly that checkpoint: a staging race would show as different losses.
FIRST_HALF=$((K_RESUME + 2))
RESUME_FROM=step_$(printf '%08d' "$K_RESUME")

OUT_DIR=${OUT_DIR%/}
WORK=${GPU_CHECK_WORK:-$OUT_DIR/steps}
llama_commands
gpt_oss_commands

plan_line() { printf '  %q' "$@"; echo; }
if [[ $PLAN == 1 ]]; then
  echo "device: $DEVICE, config: $CONFIG, budget ${BUDGET}s, out: $OUT_DIR, work: $WORK"
  for s in "${ALL_STEPS[@]}"; do
    selected "$s" || { echo "$s: not selected"; continue; }
    echo "$s (at most ${STEP_TIMEOUT[$s]}s): ${STEP_INFO[$s]}"
    case $s in
      bf16) plan_line "$PY" -m trainer "${BASE[@]}" --steps "$N_THROUGHPUT" --metrics-file "$WORK/bf16/metrics.jsonl" ;;
      compile) plan_line "$PY" -m trainer "${BASE[@]}" --set parallel.compile=true --steps "$N_THROUGHPUT" \
                 --metrics-file "$WORK/compile/metrics.jsonl" ;;
      fp16) plan_line "$PY" -m trainer "${BASE[@]}" --set parallel.param_dtype=fp16 "${FP16_LR[@]}" \
              --steps "$N_FP16" --metrics-file "$WORK/fp16/metrics.jsonl" ;;
      resume)
        plan_line "$PY" -m trainer "${BASE[@]}" "${RESUME_MODEL[@]}" "${FLAT_LR[@]}" --steps "$N_RESUME" \
          --metrics-file "$WORK/resume/uninterrupted.jsonl"
        plan_line "$PY" -m trainer "${BASE[@]}" "${RESUME_MODEL[@]}" "${FLAT_LR[@]}" --steps "$FIRST_HALF" \
          --checkpoint-dir "$WORK/resume/ckpt" --checkpoint-interval "$K_RESUME" --metrics-file "$WORK/resume/resumed.jsonl"
        plan_line "$PY" -m trainer "${BASE[@]}" "${RESUME_MODEL[@]}" "${FLAT_LR[@]}" --steps "$N_RESUME" \
          --checkpoint-dir "$WORK/resume/ckpt" --checkpoint-interval "$K_RESUME" --resume "$WORK/resume/ckpt/$RESUME_FROM" \
          --metrics-file "$WORK/resume/resumed.jsonl"
        plan_line "$PY" bench/gpu_check/rng_check.py --device "$DEVICE" --dir "$WORK/resume/ckpt-rng" \
          --output "$WORK/resume/rng.json" ;;
      throughput) plan_line "$PY" bench/trainer_throughput.py "(ranks: one per GPU; gpt-1b on CUDA, tiny on CPU)" ;;
      collectives) plan_line "$PY" -m torch.distributed.run --standalone "--nproc-per-node=(GPUs, 2+)" \
                     -m trainer.collectives --output "$WORK/collectives/result.json" ;;
      hf_llama1b)
        plan_line "$PY" -m trainer "${LLAMA_MAKE[@]}" "(once, unless $LLAMA_DIR exists)"
        plan_line "$PY" -m trainer "${LLAMA[@]}" --metrics-file "$WORK/hf_llama1b/metrics.jsonl" ;;
      torchtitan_llama1b)
        plan_line "$PY" bench/gpu_check/titan_check.py --output "$WORK/torchtitan_llama1b/check.json" \
          -- "${TITAN[@]}"
        plan_line "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 "${TITAN_RUN[@]}" \
          "${TITAN[@]}" --dump_folder "$WORK/torchtitan_llama1b/outputs" "(CUDA only)" ;;
      gpt_oss_layers)
        plan_line "$PY" bench/gpu_check/gpt_oss_arch.py "${GPT_OSS_MAKE[@]}"
        plan_line "$PY" -m trainer --estimate finetune "${GPT_OSS_SETS[@]}" --world-size 1 --json
        plan_line "$PY" bench/gpu_check/moe_paths.py --output "$WORK/gpt_oss_layers/moe_paths.json" \
          -m trainer "${GPT_OSS[@]}" --metrics-file "$WORK/gpt_oss_layers/metrics.jsonl"
        plan_line "$PY" "${GROUPED_CHECK[@]}" ;;
    esac
  done
  exit 0
fi

if [[ -e $OUT_DIR && ! -d $OUT_DIR ]]; then
  echo "error: --out $OUT_DIR exists and is not a directory; give a directory (it is created if missing)" >&2
  exit 2
fi
if ! mkdir -p "$OUT_DIR" "$WORK" 2>/dev/null || [[ ! -w $OUT_DIR || ! -w $WORK ]]; then
  echo "error: cannot write to --out $OUT_DIR (or GPU_CHECK_WORK $WORK); choose a writable directory" >&2
  exit 2
fi
OUT_DIR=$(cd "$OUT_DIR" && pwd) WORK=$(cd "$WORK" && pwd)
llama_commands
gpt_oss_commands
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$SECONDS
MODE=$([[ $DEVICE == cuda ]] && echo gpu || echo cpu)
say() { echo "[gpu-check $((SECONDS - START))s] $*" >&2; }

# --- setup: a CUDA torch, the trainer's modules --------------------------------------------------
declare -A ENV
probe() {
  local line
  ENV=()
  while IFS= read -r line; do ENV[${line%%=*}]=${line#*=}; done < <("$PY" bench/gpu_check/probe.py --mode "$MODE" --output "$WORK/env.json" 2>"$WORK/probe.err")
  [[ -n ${ENV[missing]+x} ]]
}

json_str() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\n'/ }; printf '"%s"' "$s"; }
mark_skipped() {  # step, reason
  mkdir -p "$WORK/$1"
  printf '{"step": "%s", "skipped": %s}\n' "$1" "$(json_str "$2")" >"$WORK/$1/step.json"
}

refuse() {  # why: the check cannot run here; every step is skipped with that reason
  local why=$1 s
  say "REFUSED: $why"
  for s in "${ALL_STEPS[@]}"; do mark_skipped "$s" "setup refused: $why"; done
  printf '{"refused": %s}\n' "$(json_str "$why")" >"$WORK/setup.json"
  [[ -s $WORK/env.json ]] || printf '{"mode": "%s", "python_executable": %s}\n' "$MODE" "$(json_str "$PY")" >"$WORK/env.json"
  summarize
  exit 3
}

pack_logs() {  # every step's arguments, logs and metrics; not the checkpoints nor the 2.5 GB model
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" --exclude='ckpt*' --exclude='./models' .
}

summarize() {
  local rc=0
  "$PY" bench/gpu_summary.py --work "$WORK" --out "$OUT_DIR" || rc=$?
  pack_logs 2>/dev/null || say "could not write logs.tar.gz"
  say "summary: $OUT_DIR/summary.md, $OUT_DIR/summary.json; logs: $OUT_DIR/logs.tar.gz"
  return $rc
}

pip_target() {  # install wheels or names into $SITE, never their dependencies (torch stays as it is)
  mkdir -p "$SITE"
  timeout 180 "$PY" -m pip install -q --no-deps --no-compile --disable-pip-version-check --upgrade \
    --target "$SITE" "$@" >>"$WORK/setup.log" 2>&1
}

setup() {
  rm -f "$WORK/setup.json"
  probe || refuse "$PY cannot run bench/gpu_check/probe.py: $(tail -n 1 "$WORK/probe.err")"
  local torch_before=${ENV[torch_version]} cuda_before=${ENV[cuda_version]}
  say "python: $PY, torch ${torch_before:-none}, CUDA ${cuda_before:-none}, GPUs ${ENV[gpu_count]} ${ENV[gpu_name]}"
  if [[ $DEVICE == cuda && -z $cuda_before ]]; then
    # Only a CUDA build may be installed, and only from a wheel already here (no network assumed).
    local cuda_wheel
    cuda_wheel=$(find "$WHEELS" -maxdepth 1 -type f -name 'torch-*.whl' ! -name '*+cpu*' 2>/dev/null | head -n 1)
    if [[ -z $cuda_wheel ]]; then
      refuse "torch ${torch_before:-is not installed}${torch_before:+ is a CPU build (torch.version.cuda is None)} and no CUDA torch wheel is in $WHEELS; a GPU check on CPU torch would measure nothing, and installing torch from a registry could pull a CPU build. Fix: run with a CUDA torch (PYTHON=/path/to/python), put a CUDA torch wheel and its nvidia-* wheels in --wheels, or use --dry-run for the CPU run"
    fi
    say "installing CUDA torch from $cuda_wheel (and the other wheels there) into $SITE"
    local others=()
    mapfile -t others < <(find "$WHEELS" -maxdepth 1 -type f -name '*.whl' ! -name 'torch-*' 2>/dev/null | sort)
    pip_target --no-index "$cuda_wheel" "${others[@]}" || refuse "installing $cuda_wheel failed: see $WORK/setup.log"
    export PYTHONPATH="$SITE:$PYTHONPATH"
    probe || refuse "the probe failed after installing torch: $(tail -n 1 "$WORK/probe.err")"
    [[ -n ${ENV[cuda_version]} ]] || refuse "the installed torch ${ENV[torch_version]} is not a CUDA build"
    torch_before=${ENV[torch_version]} cuda_before=${ENV[cuda_version]}
  fi
  if [[ $DEVICE == cuda && ${ENV[gpu_count]:-0} -lt 1 ]]; then
    refuse "torch $torch_before (CUDA $cuda_before) sees no GPU (torch.cuda.is_available() is False): check nvidia-smi and the driver, or use --dry-run"
  fi
  if [[ -n ${ENV[missing]} ]]; then
    local wheels=()
    mapfile -t wheels < <(find "$WHEELS" -maxdepth 1 -type f -name '*.whl' ! -name 'torch-*' 2>/dev/null | sort)
    if [[ ${#wheels[@]} -gt 0 ]]; then
      say "missing modules: ${ENV[missing]}; installing ${#wheels[@]} wheel(s) from $WHEELS into $SITE (no dependencies)"
      pip_target --no-index "${wheels[@]}" || say "installing from $WHEELS failed: see $WORK/setup.log"
    else
      say "missing modules: ${ENV[missing]}; no wheels in $WHEELS, trying the package index (no dependencies)"
      pip_target --retries 0 --timeout 15 "${HELPER_WHEELS[@]}" || say "pip install from the index failed: see $WORK/setup.log"
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
    probe || refuse "the probe failed after installing modules: $(tail -n 1 "$WORK/probe.err")"
    if [[ -n ${ENV[missing]} ]]; then
      refuse "the trainer needs Python modules ${ENV[missing]} and they could not be installed from $WHEELS or the package index (see $WORK/setup.log). Fix: on a machine with network run GPU_CHECK_WHEEL_PYTHON=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') bench/gpu_check.sh --fetch-wheels .whl and bring .whl along"
    fi
  fi
  if [[ ${ENV[torch_version]} != "$torch_before" || ${ENV[cuda_version]} != "$cuda_before" ]]; then
    refuse "torch changed from $torch_before (CUDA ${cuda_before:-none}) to ${ENV[torch_version]} (CUDA ${ENV[cuda_version]:-none}) after installing modules; remove $SITE/torch and run again"
  fi
  NGPU=${ENV[gpu_count]:-0}
  printf '{"python": %s, "pythonpath": %s, "wheels": %s}\n' "$(json_str "$PY")" "$(json_str "$PYTHONPATH")" \
    "$(json_str "$WHEELS")" >"$WORK/setup.json"
}

# --- running a step --------------------------------------------------------------------------------
RESERVE=20        # seconds kept for the summary
MIN_STEP=20       # a step is not started with less than this
STEP_DEADLINE=0
SKIPPED=99        # a step function's status for "skipped itself, step.json written"
left() { echo $((STEP_DEADLINE - SECONDS)); }

# sub NAME CMD...: one command of the current step under the step's remaining time; its arguments go
# to NAME.args (one per line, read by gpu_summary.py), its output to NAME.log.
sub() {
  local name=$1 t rc; shift
  t=$(left)
  if [[ $t -lt 5 ]]; then
    echo "not started: the step's time was used up" >"$STEP_DIR/$name.log"
    echo 124 >"$STEP_DIR/$name.rc"; return 124
  fi
  printf '%s\n' "$@" >"$STEP_DIR/$name.args"
  timeout --kill-after=15 "$t" "$@" >"$STEP_DIR/$name.log" 2>&1
  rc=$?
  echo $rc >"$STEP_DIR/$name.rc"
  return $rc
}

run_step() {  # name
  local s=$1 remaining limit began rc=0 timed_out=false
  STEP_DIR=$WORK/$s
  rm -rf "$STEP_DIR"; mkdir -p "$STEP_DIR"
  remaining=$((BUDGET - (SECONDS - START) - RESERVE))
  if [[ $remaining -lt $MIN_STEP ]]; then
    mark_skipped "$s" "time budget: ${remaining}s of the ${BUDGET}s left, under the ${MIN_STEP}s a step needs"
    say "$s: skipped (time budget)"; return
  fi
  limit=$(( STEP_TIMEOUT[$s] < remaining ? STEP_TIMEOUT[$s] : remaining ))
  STEP_DEADLINE=$((SECONDS + limit))
  began=$SECONDS
  say "$s: ${STEP_INFO[$s]} (at most ${limit}s; $DEVICE, config $CONFIG)"
  "step_$s" || rc=$?
  [[ $rc == "$SKIPPED" ]] && return  # the step wrote its own step.json
  [[ $rc == 124 || $rc == 137 ]] && timed_out=true
  printf '{"step": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "timed_out": %s, "device": "%s"}\n' \
    "$s" "$rc" "$((SECONDS - began))" "$limit" "$timed_out" "$DEVICE" >"$STEP_DIR/step.json"
  say "$s: exit $rc in $((SECONDS - began))s$([[ $timed_out == true ]] && echo ' (timed out)')"
  # What has run so far, in case the whole command is cut off before the summary.
  pack_logs 2>/dev/null
}

trainer() { sub "$1" "$PY" -m trainer "${@:2}"; }

step_bf16() {
  trainer run "${BASE[@]}" --steps "$N_THROUGHPUT" --metrics-file "$STEP_DIR/metrics.jsonl"
}

step_compile() {
  trainer run "${BASE[@]}" --set parallel.compile=true --steps "$N_THROUGHPUT" \
    --metrics-file "$STEP_DIR/metrics.jsonl"
}

step_fp16() {
  trainer run "${BASE[@]}" --set parallel.param_dtype=fp16 "${FP16_LR[@]}" --steps "$N_FP16" \
    --metrics-file "$STEP_DIR/metrics.jsonl"
}

step_resume() {
  local common=("${BASE[@]}" "${RESUME_MODEL[@]}" "${FLAT_LR[@]}") ckpt=$STEP_DIR/ckpt rc=0
  trainer uninterrupted "${common[@]}" --steps "$N_RESUME" --metrics-file "$STEP_DIR/uninterrupted.jsonl" || rc=$?
  trainer first-half "${common[@]}" --steps "$FIRST_HALF" --checkpoint-dir "$ckpt" \
    --checkpoint-interval "$K_RESUME" --metrics-file "$STEP_DIR/resumed.jsonl" || rc=$?
  trainer second-half "${common[@]}" --steps "$N_RESUME" --checkpoint-dir "$ckpt" \
    --checkpoint-interval "$K_RESUME" --resume "$ckpt/$RESUME_FROM" --metrics-file "$STEP_DIR/resumed.jsonl" || rc=$?
  sub rng "$PY" bench/gpu_check/rng_check.py --device "$DEVICE" --dir "$STEP_DIR/ckpt-rng" \
    --output "$STEP_DIR/rng.json" || rc=$?
  rm -rf "$ckpt" "$STEP_DIR/ckpt-rng"
  return $rc
}

step_throughput() {
  local args=(--steps 5 --warmup-steps 2 --output "$STEP_DIR/result.json")
  if [[ $DEVICE == cuda ]]; then
    args+=(--nproc "$NGPU")
  else
    args=(--config tiny --set distributed.device=cpu --set training.gradient_accumulation=1
          --set training.global_batch_size=8 --nproc 2 --steps 3 --warmup-steps 1 --output "$STEP_DIR/result.json")
  fi
  sub run "$PY" bench/trainer_throughput.py "${args[@]}"
}

step_collectives() {
  local nproc=$NGPU args=(--backend nccl --iters 10 --warmup 3)
  if [[ $DEVICE == cpu ]]; then
    nproc=2 args=(--backend gloo --sizes 4K,64K,1M --iters 3 --warmup 1)
  elif [[ $NGPU -lt 2 ]]; then
    mark_skipped collectives "one GPU ($NGPU visible): an all-reduce needs 2+ GPUs"
    say "collectives: skipped (one GPU)"
    return "$SKIPPED"
  fi
  sub run "$PY" -m torch.distributed.run --standalone "--nproc-per-node=$nproc" -m trainer.collectives \
    "${args[@]}" --output "$STEP_DIR/result.json"
}

write_tiny_llama() {  # $1: a Llama 3.2-shaped config.json small enough for the CPU dry run
  cat >"$1" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "intermediate_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "hidden_act": "silu",
 "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
 "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "attention_bias": false, "mlp_bias": false,
 "tie_word_embeddings": true, "torch_dtype": "bfloat16"}
EOF
}

step_hf_llama1b() {
  if [[ -f $LLAMA_DIR/config.json ]]; then
    say "hf_llama1b: reusing $LLAMA_DIR"
  else
    [[ $DEVICE == cpu ]] && { mkdir -p "$WORK/models"; write_tiny_llama "$LLAMA_ARCH"; }
    # A complete export is renamed into place (trainer/hf/weights.py): no half-written directory remains.
    trainer make-model "${LLAMA_MAKE[@]}" || return $?
  fi
  # The architecture the run loaded, for the summary's FLOPs (the model directory is not in the logs).
  cp "$LLAMA_DIR/config.json" "$STEP_DIR/model-config.json"
  trainer run "${LLAMA[@]}" --metrics-file "$STEP_DIR/metrics.jsonl"
}

step_torchtitan_llama1b() {
  local titan_wheels=$WHEELS/torchtitan titan_site=$SITE-torchtitan wheels=() reason path
  mapfile -t wheels < <(find "$titan_wheels" -maxdepth 1 -type f -name '*.whl' 2>/dev/null | sort)
  if [[ ${#wheels[@]} -gt 0 ]]; then
    rm -rf "$titan_site"
    if ! sub install timeout 180 "$PY" -m pip install -q --no-deps --no-compile --disable-pip-version-check \
        --no-index --target "$titan_site" "${wheels[@]}"; then
      reason="installing the ${#wheels[@]} wheel(s) in $titan_wheels failed: $(tail -n 1 "$STEP_DIR/install.log")"
      mark_skipped torchtitan_llama1b "$reason"
      say "torchtitan_llama1b: skipped: $reason"
      return "$SKIPPED"
    fi
  fi
  # Its own site first, then bench/gpu_check (titan_llama1b), then the trainer's path.
  path=$titan_site:$REPO/bench/gpu_check
  if ! PYTHONPATH=$path:$PYTHONPATH "$PY" -c 'import datasets' 2>/dev/null; then
    path+=:$REPO/bench/gpu_check/no_datasets
  fi
  PYTHONPATH=$path:$PYTHONPATH sub check "$PY" bench/gpu_check/titan_check.py \
    --output "$STEP_DIR/check.json" -- "${TITAN[@]}" --dump_folder "$STEP_DIR/outputs" || return $?
  reason=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("reason", ""))' \
    "$STEP_DIR/check.json")
  if [[ -n $reason ]]; then
    [[ ${#wheels[@]} -eq 0 ]] && reason+=" and no wheels are in $titan_wheels (bench/gpu_check.sh \
--fetch-wheels DIR puts them in DIR/torchtitan)"
    mark_skipped torchtitan_llama1b "$reason"
    say "torchtitan_llama1b: skipped: $reason"
    return "$SKIPPED"
  fi
  if [[ $DEVICE == cpu ]]; then
    # torchtitan/tools/utils.py: device_type falls back to "cuda" without an accelerator.
    mark_skipped torchtitan_llama1b "CPU dry run: torchtitan trains on CUDA only; it imported and parsed the \
step's options (check.json)"
    return "$SKIPPED"
  fi
  PYTHONPATH=$path:$PYTHONPATH sub run "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 \
    "${TITAN_RUN[@]}" "${TITAN[@]}" --dump_folder "$STEP_DIR/outputs"
}

step_gpt_oss_layers() {
  sub make-config "$PY" bench/gpu_check/gpt_oss_arch.py "${GPT_OSS_MAKE[@]}" || return $?
  # The estimator's figure for the same settings, beside the measured peak (the summary compares them).
  sub estimate "$PY" -m trainer --estimate finetune "${GPT_OSS_SETS[@]}" --world-size 1 --json || return $?
  local rc=0 check_rc=0
  sub run "$PY" bench/gpu_check/moe_paths.py --output "$STEP_DIR/moe_paths.json" \
    -m trainer "${GPT_OSS[@]}" --metrics-file "$STEP_DIR/metrics.jsonl" || rc=$?
  # Grouped GEMM against the per-expert loop at the same widths, forward and (on CUDA) backward: the run
  # above takes grouped GEMM on unpadded runs and nothing in it compares the two. Exit status 1 is the
  # check's verdict, in grouped_check.json, which bench/gpu_summary.py judges (it fails the step on CUDA).
  sub grouped-check "$PY" "${GROUPED_CHECK[@]}" || check_rc=$?
  [[ $rc == 0 && $check_rc != 1 ]] && rc=$check_rc
  return $rc
}

# --- main ------------------------------------------------------------------------------------------
say "device $DEVICE, budget ${BUDGET}s, out $OUT_DIR, work $WORK"
setup
for s in "${ALL_STEPS[@]}"; do
  if ! selected "$s"; then
    rm -rf "${WORK:?}/$s"; mark_skipped "$s" "not selected (--only/--skip)"; continue
  fi
  run_step "$s"
done
summarize
