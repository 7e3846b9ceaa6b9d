"""hetspot workers: the GPT model, the parallel runtime (DP/PP/TP), data, and the Ray actor adapter."""
