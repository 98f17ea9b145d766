"""rlflow: RL post-training for LLMs on Ray, tracked in MLflow."""
