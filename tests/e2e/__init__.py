"""End-to-end tests of the inference server and fast tests of its parts."""
