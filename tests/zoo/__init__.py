"""The model zoo: real PyTorch models, exported and trained through traingraph."""
