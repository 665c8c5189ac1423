"""Looking at what a run learned: one loader for runs and Hugging Face folders, generation, held-out loss."""
