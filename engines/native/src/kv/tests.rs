//! Unit tests of the paged KV cache's bookkeeping (`kv.rs`): prefix reuse, eviction,
//! sharing, forks and truncations.

use super::*;

fn run(pool: &mut BlockPool, seq: &mut SeqBlocks, tokens: &[i32]) {
    pool.grow(seq, tokens.len()).expect("grow");
    pool.commit(seq, tokens);
}

#[test]
fn a_released_prefix_is_reused_block_by_block_and_copied_where_it_diverges() {
    let mut pool = BlockPool::new(8, 4);
    let mut a = SeqBlocks::default();
    let prompt: Vec<i32> = (0..10).collect();
    run(&mut pool, &mut a, &prompt);
    assert_eq!(a.table.len(), 3);
    let a_blocks = a.table.clone();
    pool.release(&mut a);
    // Two full blocks are cached, and the partial third as a copy source.
    assert_eq!(pool.cached_idle(), 3);

    // Same first 6 tokens, then different: 4 shared + 2 copied from the cached second block.
    let mut b = SeqBlocks::default();
    let other: Vec<i32> = vec![0, 1, 2, 3, 4, 5, 99, 98];
    let (reused, copies) = pool.bind_prefix(&mut b, &other, other.len()).expect("bind");
    assert_eq!(reused, 6);
    assert_eq!(b.table[0], a_blocks[0]);
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].src, a_blocks[1]);
    assert_eq!(copies[0].slots, 2);
    assert_ne!(b.table[1], a_blocks[1], "a shared block is never written");
    pool.release(&mut b);

    // The released partial block serves a prompt that continues the same prefix.
    let mut c = SeqBlocks::default();
    let (reused, copies) = pool
        .bind_prefix(&mut c, &prompt, prompt.len() - 1)
        .expect("bind");
    assert_eq!(reused, 9);
    assert_eq!(
        copies,
        vec![BlockCopy {
            src: a_blocks[2],
            dst: c.table[2],
            slots: 1
        }]
    );
}

#[test]
fn the_last_token_is_left_to_evaluate_when_its_logits_are_needed() {
    let mut pool = BlockPool::new(8, 4);
    let mut a = SeqBlocks::default();
    let prompt: Vec<i32> = (0..8).collect();
    run(&mut pool, &mut a, &prompt);
    pool.release(&mut a);
    let mut b = SeqBlocks::default();
    let (reused, copies) = pool
        .bind_prefix(&mut b, &prompt, prompt.len() - 1)
        .expect("bind");
    assert_eq!(reused, 7);
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].slots, 3);
}

#[test]
fn cached_blocks_are_evicted_least_recently_used_when_room_is_needed() {
    let mut pool = BlockPool::new(4, 2);
    let mut a = SeqBlocks::default();
    run(&mut pool, &mut a, &[1, 2, 3, 4]);
    pool.release(&mut a);
    assert_eq!(pool.available(), 4);
    let mut b = SeqBlocks::default();
    run(&mut pool, &mut b, &[9, 9, 9, 9, 9, 9, 9, 9]);
    assert_eq!(
        pool.cached_idle(),
        0,
        "every cached block was taken for room"
    );
    assert!(pool.grow(&mut b, 1).is_err(), "full: an error, not a panic");
    pool.release(&mut b);
    let mut c = SeqBlocks::default();
    let (reused, _) = pool.bind_prefix(&mut c, &[1, 2, 3, 4], 4).expect("bind");
    assert_eq!(reused, 0, "the evicted prefix is gone");
}

#[test]
fn sharing_counts_references() {
    let mut pool = BlockPool::new(6, 2);
    let mut a = SeqBlocks::default();
    run(&mut pool, &mut a, &[1, 2, 3, 4, 5]);
    // While a still runs, b takes its full blocks.
    let mut b = SeqBlocks::default();
    let (reused, copies) = pool.bind_prefix(&mut b, &[1, 2, 3, 4, 7], 5).expect("bind");
    assert_eq!((reused, copies.len()), (4, 0));
    assert_eq!(b.table, a.table[..2].to_vec());
    pool.release(&mut a);
    assert_eq!(
        pool.cached_idle(),
        1,
        "b still uses the full blocks; a's partial one is idle"
    );
    pool.release(&mut b);
    assert_eq!(pool.cached_idle(), 3, "two full blocks and a's partial one");
    pool.drop_cached();
    assert_eq!(pool.available(), 6);
}

#[test]
fn a_fork_shares_the_full_blocks_and_copies_the_partly_filled_one() {
    let mut pool = BlockPool::new(8, 4);
    let mut a = SeqBlocks::default();
    run(&mut pool, &mut a, &(0..10).collect::<Vec<_>>());
    let (mut b, copies) = pool.fork(&a).expect("fork");
    assert_eq!(b.table[..2], a.table[..2], "the full blocks are shared");
    assert!(b.table[..2].iter().all(|&x| pool.refcount[x as usize] == 2));
    assert_ne!(b.table[2], a.table[2], "the partly filled block is private");
    assert_eq!(
        copies,
        vec![BlockCopy {
            src: a.table[2],
            dst: b.table[2],
            slots: 2
        }]
    );
    assert_eq!((b.len, &b.tokens, &b.hashes), (a.len, &a.tokens, &a.hashes));
    // Both write on independently; a block-aligned source needs no copy.
    run(&mut pool, &mut b, &[7, 7]);
    assert_eq!(b.table.len(), 3);
    let (mut c, copies) = pool.fork(&b).expect("fork");
    assert!(copies.is_empty());
    assert_eq!(c.table, b.table);
    for s in [&mut a, &mut b, &mut c] {
        pool.release(s);
    }
    pool.drop_cached();
    assert_eq!(pool.available(), 8, "every block came back");
}

#[test]
fn a_fork_on_a_full_cache_fails_and_shares_nothing() {
    let mut pool = BlockPool::new(3, 4);
    let mut a = SeqBlocks::default();
    run(&mut pool, &mut a, &(0..10).collect::<Vec<_>>());
    assert_eq!(pool.available(), 0);
    let e = pool.fork(&a).expect_err("no block for the copy");
    assert_eq!(e.status, Status::OomRam);
    assert!(a.table.iter().all(|&x| pool.refcount[x as usize] == 1));
    pool.release(&mut a);
    pool.drop_cached();
    assert_eq!(pool.available(), 3);
}

#[test]
fn a_truncation_releases_the_blocks_past_it_and_copies_a_shared_or_cached_block_on_write() {
    let mut pool = BlockPool::new(12, 4);
    let mut a = SeqBlocks::default();
    let prompt: Vec<i32> = (0..14).collect();
    run(&mut pool, &mut a, &prompt);
    let (mut b, _) = pool.fork(&a).expect("fork");
    let shared = a.table[1];
    // Inside block 1, which b reads: a gets a private copy of its first two slots.
    let dropped = a.table[2..].to_vec();
    let copies = pool.truncate(&mut a, 6).expect("truncate");
    assert_eq!(
        copies,
        vec![BlockCopy {
            src: shared,
            dst: a.table[1],
            slots: 2
        }]
    );
    assert_ne!(a.table[1], shared);
    assert_eq!(pool.refcount[shared as usize], 1, "b alone reads it now");
    assert_eq!(
        pool.refcount[a.table[0] as usize], 2,
        "block 0 is still shared"
    );
    assert_eq!(
        pool.refcount[dropped[0] as usize], 1,
        "b still reads block 2"
    );
    assert!(
        pool.refcount[dropped[1] as usize] == 0 || a.table[1] == dropped[1],
        "a's last block was released (and maybe taken for the copy)"
    );
    assert_eq!((a.len, a.table.len(), a.hashes.len()), (6, 2, 1));
    assert_eq!(a.tokens, prompt[..6]);
    // a writes on differently; b still holds its own tokens.
    run(&mut pool, &mut a, &[50, 51, 52]);
    assert_eq!(b.tokens, prompt);
    pool.release(&mut b);

    // A full block only the prefix cache indexes is copied too, and stays cached.
    let mut c = SeqBlocks::default();
    run(&mut pool, &mut c, &[9, 9, 9, 9, 8, 8]);
    let cached = c.table[0];
    assert!(pool.registered[cached as usize].is_some());
    let copies = pool.truncate(&mut c, 3).expect("truncate");
    assert_eq!(copies.len(), 1);
    assert_eq!((copies[0].src, copies[0].slots), (cached, 3));
    assert_eq!(pool.refcount[cached as usize], 0);
    assert!(
        pool.registered[cached as usize].is_some(),
        "the cache keeps it"
    );
    // A private, unindexed partial block is kept as it is; a cut at a block boundary copies
    // nothing.
    assert!(pool.truncate(&mut c, 2).expect("truncate").is_empty());
    run(&mut pool, &mut c, &[1, 2, 3, 4, 5, 6]);
    assert!(pool.truncate(&mut c, 4).expect("truncate").is_empty());
    assert_eq!(c.table.len(), 1);
    assert!(pool.truncate(&mut c, 0).expect("truncate").is_empty());
    assert!(c.table.is_empty());

    pool.release(&mut a);
    pool.release(&mut c);
    pool.drop_cached();
    assert_eq!(pool.available(), 12, "every block came back");
}

#[test]
fn a_truncation_without_a_free_block_refuses_a_shared_block_and_unregisters_a_cached_one() {
    let mut pool = BlockPool::new(2, 4);
    let mut a = SeqBlocks::default();
    run(&mut pool, &mut a, &[1, 2, 3, 4]);
    let (mut b, copies) = pool.fork(&a).expect("fork");
    assert!(copies.is_empty());
    let mut c = SeqBlocks::default();
    run(&mut pool, &mut c, &[5]);
    assert_eq!(pool.available(), 0);
    let e = pool.truncate(&mut a, 2).expect_err("no block for the copy");
    assert_eq!(e.status, Status::OomRam);
    assert_eq!((a.len, a.table.len()), (4, 1), "nothing changed");
    pool.release(&mut b);
    // a alone holds it now, and the cache indexes it: without room it leaves the cache.
    let block = a.table[0];
    assert!(pool.truncate(&mut a, 2).expect("truncate").is_empty());
    assert_eq!(a.table, vec![block]);
    assert!(pool.registered[block as usize].is_none());
    pool.release(&mut a);
    pool.release(&mut c);
    pool.drop_cached();
    assert_eq!(pool.available(), 2);
}

#[test]
fn a_prefix_is_reused_only_under_the_adapter_that_computed_it() {
    let mut pool = BlockPool::new(16, 4);
    let prompt: Vec<i32> = (0..10).collect();
    // Under adapter 7: two full blocks and a partial one cached.
    let mut a = SeqBlocks {
        adapter: 7,
        ..SeqBlocks::default()
    };
    run(&mut pool, &mut a, &prompt);
    pool.release(&mut a);
    assert_eq!(pool.cached_idle(), 3);
    // The base finds none of it, neither the full blocks nor the partial copy source.
    let mut b = SeqBlocks::default();
    let (reused, copies) = pool
        .bind_prefix(&mut b, &prompt, prompt.len() - 1)
        .expect("bind");
    assert_eq!((reused, copies.len()), (0, 0));
    run(&mut pool, &mut b, &prompt);
    pool.release(&mut b);
    // Another adapter neither.
    let mut c = SeqBlocks {
        adapter: 8,
        ..SeqBlocks::default()
    };
    let (reused, _) = pool
        .bind_prefix(&mut c, &prompt, prompt.len() - 1)
        .expect("bind");
    assert_eq!(reused, 0);
    pool.release(&mut c);
    // The same adapter takes its own blocks; a second base sequence takes the base's.
    for adapter in [7, 0] {
        let mut d = SeqBlocks {
            adapter,
            ..SeqBlocks::default()
        };
        let (reused, _) = pool
            .bind_prefix(&mut d, &prompt, prompt.len() - 1)
            .expect("bind");
        assert_eq!(reused, 9, "adapter {adapter}");
        // A fork keeps the adapter, so its blocks chain from the same root.
        let (child, _) = pool.fork(&d).expect("fork");
        assert_eq!(child.adapter, adapter);
        let mut child = child;
        pool.release(&mut child);
        pool.release(&mut d);
    }
}
