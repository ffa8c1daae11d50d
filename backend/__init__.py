"""LLM Systems Explorer backend: experiments, job runner, run store, traces. Never imports streamlit."""
