#!/usr/bin/env bash
# The GPU smoke kit: megarl on the box a user first tries it on, and the one our own GPU checks run on.
#
#   make gpu-wheels                         # here, with PyPI: megatron-core and omegaconf into .gpu-wheels/
#   tools/gpu_smoke.sh [--logs DIR]         # there: installs them, runs every step, prints one table
#   tools/gpu_smoke.sh --dry-run            # anywhere: every step found and invoked, no GPU needed or tested
#
# The box: one GPU (H100 80GB or H200), Python 3.12, torch 2.11 with CUDA, transformers, tokenizers, pyarrow,
# Triton and pytest; no megatron-core, vLLM or Transformer Engine; nothing can be downloaded. So the wheels
# travel with the checkout (installed with --no-deps into a temporary target), rollouts use the `hf` engine,
# and every job runs one rank (NCCL takes one rank per GPU). The steps run in three lanes at once (1: the user's
# path: models, parity, SFT, GRPO; 2: the gpu test files, then multi-turn GRPO with an environment; 3: the resume
# test, then mixture-of-experts models with multi-latent attention), each lane's steps one after another; the GPU
# and the box's cores hold the tiny models of all three. LANES (default "1 2 3") picks lanes to run, e.g. to run
# one again. They share a deadline of DEADLINE_S seconds (default 470, under 8 minutes); a step's log is in the
# logs folder (default: a temporary one). GRPO_STEPS (default 50) sets the length of the GRPO run.
#
# The dry run proves the plumbing: each pytest step collects its tests, each program answers --help
# (which imports all it needs). It runs no step's work and claims no GPU result.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.gpu-wheels}
DEADLINE_S=${DEADLINE_S:-470}
GRPO_STEPS=${GRPO_STEPS:-50}
LANES=${LANES:-1 2 3}
DRY_RUN=0
LOGS=""
while (($#)); do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --logs) LOGS=$2; shift ;;
        *) echo "usage: tools/gpu_smoke.sh [--dry-run] [--logs DIR]" >&2; exit 2 ;;
    esac
    shift
done
LOGS=${LOGS:-$(mktemp -d)}
WORK=$(mktemp -d)  # models, data and runs made on the spot
mkdir -p "$LOGS"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1)

# megatron-core and omegaconf: already there (a full install), or from the wheels brought along.
install_wheels() {
    if "$PYTHON" -c "import megatron.core, omegaconf" 2>/dev/null; then
        echo "megatron-core and omegaconf are installed: no wheels needed"
        return 0
    fi
    shopt -s nullglob
    local site wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]} == 0)); then
        echo "no wheels in $WHEELS: run 'make gpu-wheels' where PyPI is reachable"
        return 1
    fi
    printf '  %s\n' "${wheels[@]##*/}"
    site=$(mktemp -d)
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" || return 1
    export PYTHONPATH=$ROOT:$site
}

# step LANE NAME KIND COMMAND...: KIND is `pytest` (COMMAND is its arguments: collected in a dry run),
# `program` (a Python program and its arguments, under torchrun when COMMAND starts with `torchrun`:
# asked for --help in a dry run) or `shell` (run as it is in both modes, for what needs no GPU). The
# step's log and its table row (LANE.ORDER_NAME.{log,row}) go to the logs folder.
step() {
    local lane=$1 name=$2 kind=$3
    shift 3
    local order
    order=$(find "$LOGS" -name "$lane.*.row" | wc -l)
    local stem left=$((DEADLINE_S - SECONDS)) command=()
    stem="$LOGS/$lane.$(printf '%02d' "$order")_${name//[^A-Za-z0-9]/_}"
    if ((left <= 0)); then
        echo "$name|SKIP|0|past the kit's deadline" >"$stem.row"
        return
    fi
    case $kind in
        pytest) command=("$PYTHON" -m pytest -p no:cacheprovider -q "$@")
                ((DRY_RUN)) && command+=(--collect-only) ;;
        program) if [[ $1 == torchrun ]]; then shift; command=("${TORCHRUN[@]}" "$@"); else command=("$PYTHON" "$@"); fi
                 if ((DRY_RUN)); then
                     [[ $1 == -m ]] && command=("$PYTHON" -m "$2" --help) || command=("$PYTHON" "$1" --help)
                 fi ;;
        shell) command=("$@") ;;
    esac
    echo "== $name: ${command[*]}" >"$stem.log"
    local start=$SECONDS status
    timeout --kill-after=10 "$left" "${command[@]}" >>"$stem.log" 2>&1
    status=$?
    local seconds=$((SECONDS - start)) verdict=PASS detail
    detail=$(summary "$kind" "$stem.log")
    if ((status != 0)); then
        verdict=FAIL
        ((status == 124)) && detail="timed out; $detail"
    elif [[ $kind == pytest ]] && ! ((DRY_RUN)) && grep -qE '^[0-9]+ skipped' <(tail -n 1 "$stem.log"); then
        verdict=SKIP
    fi
    echo "$name|$verdict|$seconds|$detail" >"$stem.row"
}

# One line of what a step's log says: pytest's closing counts, the OK/FAIL lines of compare_logits, or a
# run's first and last validation score, last training loss and step time and rollout/trainer mismatch.
summary() {
    local kind=$1 log=$2
    if [[ $kind == pytest ]]; then
        grep -E '[0-9]+ (passed|failed|skipped|error|tests? collected)' "$log" | tail -n 1 | tr -d '='
    elif grep -q "max |megatron - transformers|" "$log"; then
        grep -oE '^(OK|FAIL) [^ ]+|= [0-9.e+-]+ \(tolerance [^)]*\)' "$log" | paste -sd' ' | sed -E 's#[^ ]*/##g'
    else
        local scores
        scores=$(grep -oE 'val/score/mean=[0-9.e+-]+' "$log" | sed -n '1p;$p' | cut -d= -f2 | paste -sd' ')
        echo "${scores:+val score ${scores/ / -> }  }$(for key in sft/nll agent/turns timing/step \
                                                                  mismatch/logprob_abs_diff_max; do
            grep -oE "$key=[0-9.e+-]+" "$log" | tail -n 1; done | paste -sd' ')"
    fi
}

echo "megarl GPU smoke kit ($( ((DRY_RUN)) && echo dry run || echo on the GPU)); logs in $LOGS"
install_wheels || { echo "gpu_smoke: the wheels did not install"; exit 1; }
export PYTHONPATH=${PYTHONPATH:-$ROOT}
MODELS=$WORK/models DATA=$WORK/data

step 0 "environment" program -m megarl.doctor

# parity LANE NAME MODEL...: megatron against transformers in fp32, held to the parity rule's 1e-4, and in
# bf16, held to 4x transformers' own bf16 error, measured here.
parity() {
    local lane=$1 name=$2 dtype tolerance
    shift 2
    for dtype in float32 bfloat16; do
        tolerance=$([[ $dtype == float32 ]] && echo 1e-4 || echo 4x)
        step "$lane" "$name $dtype" program torchrun checkpoints_tools/compare_logits.py --hf "$@" --dtype "$dtype" \
            --tolerance "$tolerance"
    done
}

# The user's path: tiny models, parity with transformers, the SFT warm start and GRPO on it.
user_path() {
    step 1 "tiny models" program checkpoints_tools/make_tiny_model.py --family qwen2 --out "$MODELS/qwen2"
    step 1 "tiny models (qwen3, value)" shell bash -c "
        $PYTHON checkpoints_tools/make_tiny_model.py --family qwen3 --no-tied --out $MODELS/qwen3 &&
        $PYTHON checkpoints_tools/make_tiny_model.py --family qwen2 --value-model --out $MODELS/value"
    parity 1 "compare_logits" "$MODELS/qwen2" "$MODELS/qwen3" "$MODELS/value"
    step 1 "arithmetic data" program -m megarl.data.synthetic --task arithmetic --out-dir "$DATA" \
        --num-train 20000 --num-test 500 --seed 0
    step 1 "SFT warm start (bf16)" program torchrun launchers/train_sft.py --config configs/quickstart_sft.yaml \
        "model.path=$MODELS/qwen2" "data.train_files=[$DATA/train.parquet]" "trainer.output_dir=$WORK/runs" \
        model.dtype=bfloat16 'trainer.loggers=[console]'
    step 1 "GRPO $GRPO_STEPS steps (hf engine, bf16)" program torchrun launchers/train_ppo.py \
        --config configs/quickstart.yaml "model.path=$WORK/runs/quickstart_sft/hf" \
        "data.train_files=[$DATA/train.parquet]" "data.val_files=[$DATA/test.parquet]" \
        "trainer.output_dir=$WORK/runs" "trainer.total_steps=$GRPO_STEPS" trainer.test_freq=0 trainer.log_freq=10 \
        data.max_val_samples=200 rollout.backend=hf model.dtype=bfloat16 'trainer.loggers=[console]'
}

# The gpu-marked test files, but the resume test: it has a lane of its own. Then multi-turn GRPO from a random
# tiny model: trajectories of 3 turns, the test environment answering the first two (rendered observations, the
# environment's tokens out of the loss).
gpu_tests_and_agent() {
    step 2 "every megarl module imports" shell "$PYTHON" tools/import_every_module.py
    local test_file
    for test_file in tests/gpu/test_*.py; do
        [[ $test_file == */$RESUME_TEST ]] || step 2 "${test_file#tests/gpu/}" pytest -m gpu "$test_file"
    done
    step 2 "tiny model and data (multi-turn)" shell bash -c "
        $PYTHON checkpoints_tools/make_tiny_model.py --family qwen2 --out $MODELS/agent &&
        $PYTHON -m megarl.data.synthetic --task arithmetic --out-dir $WORK/agent_data --num-train 2000 --num-test 50"
    step 2 "GRPO 5 steps multi-turn (hf engine, bf16)" program torchrun launchers/train_ppo.py \
        --config configs/quickstart.yaml "model.path=$MODELS/agent" \
        "data.train_files=[$WORK/agent_data/train.parquet]" "data.val_files=[$WORK/agent_data/test.parquet]" \
        "trainer.output_dir=$WORK/agent_runs" trainer.total_steps=5 trainer.test_freq=0 trainer.log_freq=1 \
        data.max_val_samples=50 rollout.backend=hf model.dtype=bfloat16 'trainer.loggers=[console]' \
        rollout.multi_turn.enable=true rollout.multi_turn.max_turns=3 rollout.multi_turn.reward=function \
        rollout.multi_turn.max_tokens_per_turn=8 data.max_response_length=76 data.max_prompt_length=32 \
        "rollout.multi_turn.environment=$ROOT/tests/integration/user_environment.py:AnswerEveryTurn"
}

# The resume test, then DeepSeek-V3 (multi-latent attention, sigmoid routing with groups, YaRN), GLM-4.5 and
# Qwen3-MoE: parity with transformers, and GRPO steps of the MLA model from its random start.
resume_and_moe() {
    step 3 "$RESUME_TEST" pytest -m gpu "tests/gpu/$RESUME_TEST"
    step 3 "tiny MoE models" shell bash -c "
        $PYTHON checkpoints_tools/make_tiny_model.py --family deepseek_v3 --rope-type yarn --n-group 2 --no-tied \
            --out $MODELS/deepseek_v3 &&
        $PYTHON checkpoints_tools/make_tiny_model.py --family glm4_moe --out $MODELS/glm4_moe &&
        $PYTHON checkpoints_tools/make_tiny_model.py --family qwen3_moe --out $MODELS/qwen3_moe &&
        $PYTHON -m megarl.data.synthetic --task arithmetic --out-dir $WORK/moe_data --num-train 2000 --num-test 50"
    parity 3 "compare_logits MoE" "$MODELS/deepseek_v3" "$MODELS/glm4_moe" "$MODELS/qwen3_moe"
    step 3 "GRPO 5 steps DeepSeek-V3 (hf engine, bf16)" program torchrun launchers/train_ppo.py \
        --config configs/mla_quickstart.yaml "model.path=$MODELS/deepseek_v3" actor.ep=1 \
        "data.train_files=[$WORK/moe_data/train.parquet]" "data.val_files=[$WORK/moe_data/test.parquet]" \
        "trainer.output_dir=$WORK/runs" trainer.total_steps=5 trainer.test_freq=0 trainer.log_freq=1 \
        data.max_val_samples=50 model.dtype=bfloat16 'trainer.loggers=[console]'
}

RESUME_TEST=test_resume_gpu.py
[[ " $LANES " == *" 1 "* ]] && user_path &
[[ " $LANES " == *" 2 "* ]] && gpu_tests_and_agent &
[[ " $LANES " == *" 3 "* ]] && resume_and_moe &
wait

echo
printf '%-44s %-5s %6s  %s\n' step result secs detail
FAILED=0
for row in "$LOGS"/*.row; do
    IFS='|' read -r name verdict seconds detail <"$row"
    printf '%-44s %-5s %6s  %s\n' "$name" "$verdict" "$seconds" "$detail"
    [[ $verdict == FAIL ]] && FAILED=1
done
echo "total ${SECONDS}s; logs in $LOGS"
for row in "$LOGS"/*.row; do
    if grep -q '|FAIL|' "$row"; then
        echo "---- the end of ${row%.row}.log:"
        tail -n 25 "${row%.row}.log"
    fi
done
rm -rf "$WORK"
exit $FAILED
