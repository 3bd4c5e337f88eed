"""The toy engine's parts; ``kvlend.demo.toy_engine`` gathers them under one name."""
