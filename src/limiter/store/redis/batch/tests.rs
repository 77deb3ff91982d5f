use super::*;

/// Each call's keys, and the task it was sent from.
type Calls = Arc<Mutex<Vec<(Vec<String>, Option<tokio::task::Id>)>>>;

/// A flush that records each call's keys and the task it ran in, answers after
/// `delay`, with REPLY_WIDTH copies of each key's number.
fn recording(delay: Duration) -> (Flush, Calls) {
    recording_by(move |_| delay)
}

/// [`recording`], answering each call after `delay_of` its keys.
fn recording_by(
    delay_of: impl Fn(&[String]) -> Duration + Send + Sync + 'static,
) -> (Flush, Calls) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = calls.clone();
    let flush: Flush = Box::new(move |keys: Vec<Key>, _args: Vec<u64>| {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let seen = seen.clone();
        let delay = delay_of(&keys);
        Box::pin(async move {
            seen.lock()
                .unwrap()
                .push((keys.clone(), tokio::task::try_id()));
            tokio::time::sleep(delay).await;
            let reply = keys
                .iter()
                .flat_map(|k| [k.parse::<i64>().unwrap(); REPLY_WIDTH])
                .collect();
            (Ok(reply), StoreCall::default())
        })
    });
    (flush, calls)
}

#[tokio::test]
async fn an_idle_batcher_sends_from_the_submitters_task_and_queues_the_rest_in_order() {
    let (flush, calls) = recording(Duration::from_millis(50));
    let batcher = Batcher::spawn(flush, Duration::from_secs(5));
    let first = batcher.enqueue(vec!["1".into()], vec![]);
    let queued: Vec<_> = (2..5)
        .map(|k| batcher.enqueue(vec![k.to_string().into()], vec![]))
        .collect();
    let me = tokio::spawn(async move {
        let id = tokio::task::id();
        (first.await, id)
    });
    let (answer, submitter) = me.await.unwrap();
    assert_eq!(answer.0.unwrap().to_vec(), vec![1; REPLY_WIDTH]);
    assert_eq!(
        (answer.1.operations, answer.1.requests),
        (1, 1),
        "sent alone"
    );
    for (k, q) in (2..5).zip(queued) {
        let (answer, call) = q.await;
        assert_eq!(answer.unwrap().to_vec(), vec![k; REPLY_WIDTH]);
        assert_eq!((call.operations, call.requests), (3, 3), "the batch's size");
    }
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 2, "one call, then the queue in one call");
    assert_eq!(calls[0].0, ["1"]);
    assert_eq!(
        calls[0].1,
        Some(submitter),
        "sent from the submitter's task"
    );
    assert_eq!(calls[1].0, ["2", "3", "4"]);
    assert_ne!(calls[1].1, Some(submitter));
}

#[tokio::test]
async fn a_submitter_that_goes_away_still_has_its_call_sent_and_the_queue_goes_on() {
    let (flush, calls) = recording(Duration::from_millis(20));
    let batcher = Batcher::spawn(flush, Duration::from_secs(5));
    drop(batcher.enqueue(vec!["7".into()], vec![])); // never polled
    let next = batcher.enqueue(vec!["8".into()], vec![]);
    assert_eq!(next.await.0.unwrap().to_vec(), vec![8; REPLY_WIDTH]);
    // And the batcher is idle again: the next call is sent by its submitter.
    let again = batcher.enqueue(vec!["9".into()], vec![]);
    assert_eq!(again.await.0.unwrap().to_vec(), vec![9; REPLY_WIDTH]);
    let calls = calls.lock().unwrap();
    let keys: Vec<&[String]> = calls.iter().map(|(k, _)| k.as_slice()).collect();
    assert_eq!(
        keys,
        [["7"], ["8"], ["9"]],
        "the dropped submitter's call went first"
    );
}

/// A queued submission gets no timer of its own: the queue's task answers it with a
/// timeout at its batch's deadline (twice `store.timeout` after the first item was
/// queued), and still sends its call and finishes it before the next goes out.
#[tokio::test]
async fn a_queued_submission_times_out_at_its_deadline_and_its_call_still_goes_out() {
    // Key 2 takes 1 s, far past the 2 x 100 ms bound; every other call 10 ms.
    let slow = |keys: &[String]| keys.iter().any(|k| k == "2");
    let (flush, calls) =
        recording_by(move |keys| Duration::from_millis(if slow(keys) { 1000 } else { 10 }));
    let batcher = Batcher::spawn(flush, Duration::from_millis(100));
    let first = batcher.enqueue(vec!["1".into()], vec![]);
    let queued_at = Instant::now();
    let slow = batcher.enqueue(vec!["2".into()], vec![]);
    let behind = batcher.enqueue(vec!["3".into()], vec![]);
    assert_eq!(first.await.0.unwrap().to_vec(), vec![1; REPLY_WIDTH]);
    for answer in [slow.await.0, behind.await.0] {
        assert!(
            matches!(answer, Err(StoreError::Timeout(200))),
            "{answer:?}"
        );
    }
    let waited = queued_at.elapsed();
    assert!(
        waited < Duration::from_millis(900),
        "answered at the deadline, not when the slow call ended: {waited:?}"
    );
    // The slow call went out and the queue goes on after it, in order.
    let _ = batcher.enqueue(vec!["4".into()], vec![]).await;
    let calls = calls.lock().unwrap();
    let keys: Vec<&[String]> = calls.iter().map(|(k, _)| k.as_slice()).collect();
    assert_eq!(
        keys,
        [
            vec!["1".to_string()],
            vec!["2".into(), "3".into()],
            vec!["4".into()]
        ]
    );
}

/// The items of submitters on two `per_core` workers share one call, answered on
/// worker 0: worker 0's items are answered at once, worker 1's in one group handed
/// to worker 1's runtime (one cross-thread wake per call, not per item), and every
/// submitter gets its own slice.
#[test]
fn answers_go_home_in_one_group_per_other_worker() {
    // Long enough for worker 1 to queue its items while the first call is in flight,
    // on a loaded machine too.
    let (flush, calls) = recording(Duration::from_secs(2));
    let rt0 = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let batcher = Arc::new(rt0.block_on(async { Batcher::spawn(flush, Duration::from_secs(5)) }));
    // Worker 1 queues three items behind worker 0's call in flight.
    let (go, ready) = std::sync::mpsc::channel::<()>();
    let (queued_tx, queued_rx) = std::sync::mpsc::channel::<()>();
    let b1 = batcher.clone();
    let worker1 = std::thread::spawn(move || {
        crate::worker::pretend(1, 2);
        let rt1 = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt1.block_on(async move {
            ready.recv().unwrap();
            let mine: Vec<_> = (10..13)
                .map(|k| b1.enqueue(vec![k.to_string().into()], vec![]))
                .collect();
            queued_tx.send(()).unwrap();
            let mut got = Vec::new();
            for f in mine {
                got.push(f.await.0.unwrap().to_vec());
            }
            got
        })
    });
    crate::worker::pretend(0, 2);
    let answers = rt0.block_on(async {
        let first = batcher.enqueue(vec!["1".into()], vec![]);
        let sending = tokio::spawn(first);
        tokio::task::yield_now().await; // the call is in flight
        go.send(()).unwrap();
        tokio::task::spawn_blocking(move || queued_rx.recv().unwrap())
            .await
            .unwrap();
        let own = batcher.enqueue(vec!["2".into()], vec![]);
        (
            sending.await.unwrap().0.unwrap().to_vec(),
            own.await.0.unwrap().to_vec(),
        )
    });
    assert_eq!(answers.0, vec![1; REPLY_WIDTH]);
    assert_eq!(answers.1, vec![2; REPLY_WIDTH]);
    let theirs = worker1.join().unwrap();
    assert_eq!(
        theirs,
        vec![
            vec![10; REPLY_WIDTH],
            vec![11; REPLY_WIDTH],
            vec![12; REPLY_WIDTH]
        ]
    );
    let calls = calls.lock().unwrap();
    let keys: Vec<&[String]> = calls.iter().map(|(k, _)| k.as_slice()).collect();
    assert_eq!(
        keys,
        [
            vec!["1".to_string()],
            vec!["10".into(), "11".into(), "12".into(), "2".into()]
        ]
    );
}

/// How answers are grouped: this worker's and no worker's first, at once; each other
/// worker's in one group, in submission order.
#[test]
fn answers_are_grouped_by_the_worker_they_go_to() {
    let home = Some;
    let homes = [home(3), None, home(5), home(3), home(5), home(3)];
    let mut rxs = Vec::new();
    let mut replies = Vec::new();
    for h in homes {
        let (tx, rx) = oneshot::channel();
        replies.push((tx, h));
        rxs.push(rx);
    }
    let answers = (0..6).map(|i| Ok(Integers::from_slice(&[i]))).collect();
    let groups = by_home(replies, answers);
    let shape: Vec<(bool, Vec<i64>)> = groups
        .iter()
        .map(|(worker, g)| {
            (
                worker.is_some(),
                g.iter().map(|(_, a)| a.as_ref().unwrap()[0]).collect(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [(false, vec![1]), (true, vec![0, 3, 5]), (true, vec![2, 4])]
    );
}
