package gateway

import "slices"

// One writer per tenant (KindConfig.SingleWriter): a tenant's requests go to the instance of
// its shard with the highest rendezvous weight for it. Every gateway computes the same choice
// from the same directory, and when an instance leaves only its own tenants move (to their
// next-highest instance), so sibling instances do not race on a tenant's state.

// pickWriter chooses st's writer among insts, skipping tried instances and open circuits.
func pickWriter(insts []*instance, tried []*instance, tenant string) *instance {
	var skipArr [16]*instance
	skip := append(skipArr[:0], tried...)
	for {
		var best *instance
		var bestW uint64
		for _, in := range insts {
			if slices.Contains(skip, in) || !in.breaker.Available() {
				continue
			}
			if w := weight(tenant, in.key); best == nil || w > bestW {
				best, bestW = in, w
			}
		}
		if best == nil || best.breaker.Allow() {
			return best
		}
		skip = append(skip, best) // a probe is already out
	}
}

// weight is the rendezvous weight of (tenant, instance): FNV-1a over both, then a 64-bit
// finalizer so close keys spread.
func weight(tenant, key string) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := 0; i < len(tenant); i++ {
		h = (h ^ uint64(tenant[i])) * prime
	}
	h = (h ^ 0xff) * prime
	for i := 0; i < len(key); i++ {
		h = (h ^ uint64(key[i])) * prime
	}
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}
