"""The slot request and worker spec: the one schema every layer and the API share."""
