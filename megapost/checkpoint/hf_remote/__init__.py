"""Self-contained ``transformers`` files copied into an exported model directory (trust_remote_code):
they import only torch and transformers, never megapost."""
