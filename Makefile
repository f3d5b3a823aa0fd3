# The two commands of the README. Each creates or updates .venv and installs what it needs;
# with everything installed they go straight to work.
VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
OUT := outputs/quickstart
TORCHRUN := $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=2
export OMP_NUM_THREADS := 1

.PHONY: quickstart moe-quickstart mla-quickstart opd-quickstart lora-quickstart agent-quickstart judge-quickstart test install docker-check gpu-wheels clean

# The main job on the embedded default: a tiny Qwen2 and its tokenizer made here, synthetic "a+b="
# tasks, a short SFT warm start, then GRPO on 2 CPU processes (curves in $(OUT)/quickstart_grpo).
quickstart: $(INSTALLED)
	$(PYTHON) checkpoints_tools/make_tiny_model.py --family qwen2 --out $(OUT)/base
	$(PYTHON) -m megarl.data.synthetic --task arithmetic --out-dir $(OUT)/data --num-train 20000 --num-test 500 --seed 0
	$(TORCHRUN) launchers/train_sft.py --config configs/quickstart_sft.yaml
	$(TORCHRUN) launchers/train_ppo.py --config configs/quickstart.yaml

# The same job with a tiny Qwen3-MoE (8 experts of 192, top-2) trained at expert parallelism 2: SFT warm
# start, then GRPO (curves in outputs/moe_quickstart/moe_quickstart_grpo).
moe-quickstart: $(INSTALLED)
	$(PYTHON) checkpoints_tools/make_tiny_model.py --family qwen3_moe --moe-ffn-hidden-size 192 --out outputs/moe_quickstart/base
	$(PYTHON) -m megarl.data.synthetic --task arithmetic --out-dir outputs/moe_quickstart/data --num-train 20000 --num-test 500 --seed 0
	$(TORCHRUN) launchers/train_sft.py --config configs/moe_quickstart_sft.yaml
	$(TORCHRUN) launchers/train_ppo.py --config configs/moe_quickstart.yaml

# The same job with a tiny DeepSeek-V3 (multi-latent attention with a 576-wide latent, a dense first layer, 8 experts
# of 192 routed by sigmoid scores with a correction bias) at EP2, rollouts from the `hf` engine (curves in
# outputs/mla_quickstart/mla_quickstart_grpo).
mla-quickstart: $(INSTALLED)
	$(PYTHON) checkpoints_tools/make_tiny_model.py --family deepseek_v3 --hidden-size 256 --num-layers 3 \
		--kv-lora-rank 512 --qk-rope-head-dim 64 --q-lora-rank 96 --moe-ffn-hidden-size 192 --no-tied \
		--out outputs/mla_quickstart/base
	$(PYTHON) -m megarl.data.synthetic --task arithmetic --out-dir outputs/mla_quickstart/data --num-train 20000 --num-test 500 --seed 0
	$(TORCHRUN) launchers/train_sft.py --config configs/mla_quickstart_sft.yaml
	$(TORCHRUN) launchers/train_ppo.py --config configs/mla_quickstart.yaml

# On-policy distillation on the quick start's task, after `make quickstart` (its SFT model is the student):
# the quick start's GRPO run again, saved at its last step and exported, is the teacher; then OPD from the
# SFT model (curves in $(OUT)/opd_quickstart beside the teacher's own GRPO curve in $(OUT)/quickstart_grpo).
opd-quickstart: $(INSTALLED)
	$(TORCHRUN) launchers/train_ppo.py --config configs/quickstart.yaml \
		trainer.save_freq=1500 trainer.checkpoint_dir=$(OUT)/checkpoints
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=1 checkpoints_tools/convert_to_hf.py \
		--checkpoint $(OUT)/checkpoints/quickstart_grpo/global_step_1500 --output $(OUT)/quickstart_grpo/hf --verify
	$(TORCHRUN) launchers/train_ppo.py --config configs/opd_quickstart.yaml

# LoRA on the quick start's task, after `make quickstart` (its SFT model is the base): rank-16 adapters on every
# projection, the base frozen (curves in $(OUT)/quickstart_lora; docs/recipes/lora.md).
lora-quickstart: $(INSTALLED)
	$(TORCHRUN) launchers/train_ppo.py --config configs/quickstart.yaml actor.lora.rank=16 actor.lora.alpha=32 \
		actor.optim.lr=1e-3 trainer.experiment_name=quickstart_lora

# Agentic RL: "a*b" with the calculator tool. A tiny Qwen2 and its tokenizer made here, chats whose warm-start
# targets call the calculator half of the time, a short SFT warm start on them (rendered with its chat template
# and the calculator's schema, as the RL run renders its trajectories), then multi-turn GRPO on 2 CPU
# processes (curves in outputs/agent_quickstart/agent_quickstart_grpo).
agent-quickstart: $(INSTALLED)
	$(PYTHON) checkpoints_tools/make_tiny_model.py --family qwen2 --out outputs/agent_quickstart/base
	$(PYTHON) -m megarl.data.synthetic --task multiplication --out-dir outputs/agent_quickstart/data \
		--num-train 4000 --num-test 200 --seed 0
	$(TORCHRUN) launchers/train_sft.py --config configs/agent_quickstart_sft.yaml
	$(TORCHRUN) launchers/train_ppo.py --config configs/agent_quickstart.yaml

# The quick start rewarded by a generative judge, after `make quickstart` (its SFT model is the policy): the SFT
# policy's sampled answers to training and held-out prompts, scored by the rule; a tiny Qwen2 judge fine-tuned on the
# training ones to give the rule's verdict; its agreement with the rule on the held-out ones; then GRPO rewarded by
# the judge, validated by the rule (curves in outputs/judge_quickstart/judge_quickstart_grpo; docs/recipes/judge.md).
JUDGE := outputs/judge_quickstart
judge-quickstart: $(INSTALLED)
	$(TORCHRUN) launchers/generate.py --config configs/quickstart.yaml --output $(JUDGE)/data/candidates_train.jsonl \
		data.val_files=[$(OUT)/data/train.parquet] data.max_val_samples=8000 rollout.val_n=4 rollout.val_temperature=1.0
	$(TORCHRUN) launchers/generate.py --config configs/quickstart.yaml --output $(JUDGE)/data/candidates_test.jsonl \
		rollout.val_n=4 rollout.val_temperature=1.0
	$(PYTHON) examples/judge/make_data.py --config configs/judge_quickstart.yaml \
		--samples $(JUDGE)/data/candidates_train.jsonl --out $(JUDGE)/data/judge_train.parquet
	$(PYTHON) checkpoints_tools/make_tiny_model.py --family qwen2 --seed 1 --out $(JUDGE)/base
	$(TORCHRUN) launchers/train_sft.py --config configs/judge_sft.yaml
	$(PYTHON) examples/judge/agreement.py --config configs/judge_quickstart.yaml \
		--samples $(JUDGE)/data/candidates_test.jsonl
	$(TORCHRUN) launchers/train_ppo.py --config configs/judge_quickstart.yaml

test: $(INSTALLED)
	$(PYTHON) -m megarl.doctor --require core
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest

install: $(INSTALLED)

# vLLM's CPU build drags in CUDA builds of torchvision/torchaudio/torchcodec and triton, which
# break `import transformers` next to the CPU torch: they are removed after installing.
$(INSTALLED): setup.py
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e ".[cpu,test]"
	$(PYTHON) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

# Resolves the GPU image's pins (requirements-gpu.txt with megarl's own) for its Python and platform,
# binary-only, and checks torch's CUDA against the base image: no Docker, no GPU, PyPI only (~1 min).
docker-check: $(INSTALLED)
	$(PYTHON) tools/docker_check.py

# The wheels the GPU smoke kit (tools/gpu_smoke.sh) installs on an air-gapped GPU box that has torch but
# not megatron-core or omegaconf: cp312 manylinux, megarl's pins, into .gpu-wheels/; fails over 40 MiB.
gpu-wheels: $(INSTALLED)
	$(PYTHON) tools/gpu_wheels.py

clean:
	rm -rf $(VENV) outputs
