"""Building blocks of the model. Tensor-parallel sharding lives here, in the linear layers' weight loaders."""
