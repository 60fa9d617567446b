"""Images for Qwen3-VL and Qwen3.5: decoding and checks (media), message parts (messages), the image
processor (preprocess), 3-axis rope positions (positions) and the vision tower (encoder)."""
