"""LLM Systems Explorer backend: experiments, job runner, run store, traces. Never imports streamlit."""
import kernels  # noqa: F401  chooses Triton's interpreter on a CPU before anything (torch.fx, dynamo) imports triton
