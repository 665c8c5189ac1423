"""The models: Flax NNX definitions with a pure apply, and Hugging Face model folders in and out."""
