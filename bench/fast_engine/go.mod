module llmgw.bench/fast_engine

go 1.19
