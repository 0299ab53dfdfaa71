"""Feed-forward pieces (dense MLP, routed MoE, ...)."""
