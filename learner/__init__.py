"""The learner: DeepSpeed ZeRO GRPO training from the trajectories stream."""
