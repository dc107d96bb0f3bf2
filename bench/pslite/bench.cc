// ps-lite anchor for ferrogloo's ps_bench: push+pull of a gradient over 16 keys (equal
// lengths), summed by the server; median time per size.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <unordered_map>
#include "ps/ps.h"
using namespace ps;

struct Sum {
  std::unordered_map<Key, std::vector<float>> store;
  void operator()(const KVMeta& m, const KVPairs<float>& d, KVServer<float>* s) {
    size_t n = d.keys.size();
    KVPairs<float> res;
    size_t per = (n && m.push) ? d.vals.size() / n : 0;
    if (m.push) {
      for (size_t i = 0; i < n; ++i) {
        auto& v = store[d.keys[i]];
        if (v.empty()) v.resize(per);
        for (size_t j = 0; j < per && j < v.size(); ++j) v[j] += d.vals[i * per + j];
      }
    }
    if (m.pull) {
      std::vector<float> out;
      std::vector<int> lens;
      for (size_t i = 0; i < n; ++i) {
        auto& v = store[d.keys[i]];
        out.insert(out.end(), v.begin(), v.end());
        lens.push_back(v.size());
      }
      res.keys = d.keys;
      res.vals = SArray<float>(out);
      res.lens = SArray<int>(lens);
    }
    s->Response(m, res);
  }
};

int main() {
  Start(0);
  if (IsServer()) {
    auto server = new KVServer<float>(0);
    server->set_request_handle(Sum());
    RegisterExitCallback([server]() { delete server; });
  }
  if (IsWorker()) {
    KVWorker<float> kv(0, 0);
    for (size_t bytes : {size_t(4096), size_t(4194304)}) {
      size_t total = bytes / 4 / 16 * 16;
      std::vector<Key> keys(16);
      for (int i = 0; i < 16; ++i) keys[i] = kMaxKey / 16 * i + bytes;  // keys of their own per size
      std::sort(keys.begin(), keys.end());
      std::vector<float> vals(total, 1.0f);
      int iters = bytes >= (1 << 20) ? 100 : 1000;
      std::vector<double> t;
      for (int it = 0; it < iters + 5; ++it) {
        std::vector<float> outs;
        std::vector<int> lens;
        auto a = std::chrono::steady_clock::now();
        kv.Wait(kv.PushPull(keys, vals, &outs, &lens));
        auto b = std::chrono::steady_clock::now();
        if (it >= 5) t.push_back(std::chrono::duration<double, std::micro>(b - a).count());
      }
      std::sort(t.begin(), t.end());
      if (MyRank() == 0)
        printf("pslite %zu B, %d servers, %d workers: push+pull median %.1f us (%.2f GB/s per worker)\n", bytes,
               NumServers(), NumWorkers(), t[t.size() / 2], 2.0 * total * 4 / (t[t.size() / 2] * 1e3));
    }
  }
  Finalize(0, true);
  return 0;
}
