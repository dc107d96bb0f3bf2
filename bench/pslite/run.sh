#!/bin/bash
# run.sh SERVERS WORKERS: a local ps-lite job of pslite_bench.
S=$1; W=$2; PORT=$((20000 + RANDOM % 20000))
export DMLC_NUM_SERVER=$S DMLC_NUM_WORKER=$W DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=$PORT DMLC_INTERFACE=lo
DMLC_ROLE=scheduler ./pslite_bench &
for i in $(seq $S); do DMLC_ROLE=server ./pslite_bench & done
for i in $(seq $W); do DMLC_ROLE=worker ./pslite_bench & done
wait
