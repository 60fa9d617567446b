"""The fused decode step: one token of a dense decoder as a single compiled call on every
thread (decode_step), its workers meeting at a spin barrier (sync)."""
