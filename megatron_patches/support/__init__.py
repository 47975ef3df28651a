"""Running on CPU (gloo), launching ranks, reporting the first failure."""
