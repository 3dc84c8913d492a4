"""hifigrad: high-fidelity (float32) gradients for JAX models computed in bf16, fp16 or fp8."""
