"""Images for Qwen3-VL: decoding and checks (media), message parts (messages), the image
processor (preprocess), 3-axis rope positions (positions) and the vision tower (encoder)."""
